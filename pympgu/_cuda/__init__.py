"""pympgu's compiled CUDA layer (the extension ``_core``); ``pympgu.cuda`` is its front."""
from ._core import *  # noqa: F401,F403
from ._core import __doc__  # noqa: F401
