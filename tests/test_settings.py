"""pympgu.settings: every PYMPGU_* variable read once, checked, and compared between ranks."""
import pytest

from pympgu import settings
from pympgu.settings import Settings, SettingsError


def test_defaults_and_overrides():
    assert settings.load({}) == Settings()
    got = settings.load({"PYMPGU_SPLIT_MAX_RANKS": "4", "PYMPGU_NO_P2P": "1",
                         "PYMPGU_CE_CHUNK_BYTES": " 8388608 ", "PYMPGU_BESIDE_BLOCKS": ""})
    assert (got.split_max_ranks, got.no_p2p, got.ce_chunk_bytes) == (4, True, 8 << 20)
    assert got.beside_blocks == Settings().beside_blocks  # empty: the default
    # Every field has its variable, and only the variables of fields are read.
    assert Settings.variable("ll_max_bytes") == "PYMPGU_LL_MAX_BYTES"
    assert settings.load({"PYMPGU_NO_SUCH_THING": "x"}) == Settings()


@pytest.mark.parametrize("name,value,says", [
    ("PYMPGU_SPLIT_MAX_RANKS", "0", "PYMPGU_SPLIT_MAX_RANKS must be a whole number, 1 to 8; got '0'"),
    ("PYMPGU_BESIDE_BLOCKS", "513", "PYMPGU_BESIDE_BLOCKS must be a whole number, 1 to 512"),
    ("PYMPGU_PUSH_MIN_BYTES", "16M", "PYMPGU_PUSH_MIN_BYTES must be a whole number, 0 or more; "
                                     "got '16M'"),
    ("PYMPGU_LL_MAX_BYTES", "-1", "PYMPGU_LL_MAX_BYTES must be a whole number, 0 or more"),
    ("PYMPGU_NO_P2P", "yes", "PYMPGU_NO_P2P must be 0 or 1, got 'yes'"),
])
def test_a_bad_value_names_its_variable(name, value, says):
    with pytest.raises(SettingsError, match=says):
        settings.load({name: value})


def test_fingerprint_tells_settings_apart():
    a, b = Settings(), settings.load({"PYMPGU_SPLIT_MIN_BYTES": "0"})
    assert a.fingerprint() == Settings().fingerprint() != b.fingerprint()
    assert "split_min_bytes=0" in b.fingerprint()


def test_read_once_until_reloaded(pympgu_env, monkeypatch):
    settings.reload()
    first = settings.get()
    monkeypatch.setenv("PYMPGU_SPLIT_MIN_BYTES", "123")
    assert settings.get() is first  # read once
    pympgu_env(split_min_bytes=456)
    assert settings.get().split_min_bytes == 456


def test_the_command_line_names_a_bad_setting(monkeypatch, capsys):
    from pympgu.training import cli
    monkeypatch.setenv("PYMPGU_SPLIT_MAX_RANKS", "many")
    settings.reload()
    try:
        with pytest.raises(SystemExit) as info:
            cli.main(["--cpu", "2"])
    finally:
        monkeypatch.undo()
        settings.reload()
    assert info.value.code == 2
    assert "PYMPGU_SPLIT_MAX_RANKS must be a whole number, 1 to 8; got 'many'" in \
        capsys.readouterr().err
