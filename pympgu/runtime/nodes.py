"""Where a run's nodes are and how they meet: flags, or the environment of Slurm, Open MPI
and torchrun, and the secret that authenticates the nodes to each other.

One launcher runs on each node (``srun --ntasks-per-node=1``, ``mpirun --map-by ppr:1:node``,
``torchrun --nproc-per-node=1``, or a plain shell on each); it starts that node's workers
itself. Node 0's launcher listens at the coordinator's address for the others; pympgu starts
no remote process.

    python -m pympgu.train --nnodes 2 --node-rank 0 --coordinator node0:29400 --gpus 0 1
"""
import dataclasses
import os
import re
import stat

from ..errors import FlagError

SECRET_ENV = "PYMPGU_SECRET"
COORDINATOR_ENV = "PYMPGU_COORDINATOR"
DEFAULT_PORT = 29400
MAX_NODES = 64
MIN_SECRET_BYTES = 16


# The nodes cannot meet as asked: ``flag`` names the flag or variable at fault.
NodesError = FlagError


@dataclasses.dataclass(frozen=True)
class Nodes:
    """This launcher's place among the run's nodes."""

    nnodes: int = 1
    node_rank: int = 0
    host: str = "127.0.0.1"  # node 0's address, as the other nodes reach it
    port: int = DEFAULT_PORT
    source: str = "flags"  # where this came from: flags, Slurm, Open MPI or torchrun

    @property
    def address(self):
        return f"{self.host}:{self.port}"

    @property
    def loopback(self):
        return self.host in ("127.0.0.1", "localhost", "::1")

    def check(self):
        if not 1 <= self.nnodes <= MAX_NODES:
            raise NodesError("--nnodes", f"--nnodes must be 1 to {MAX_NODES}, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise NodesError("--node-rank", f"--node-rank must be 0 to {self.nnodes - 1}, got "
                                            f"{self.node_rank}")
        if not 1 <= self.port <= 65535:
            raise NodesError("--coordinator", f"--coordinator {self.address}: no such port")
        return self


def _address(text, flag):
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise NodesError(flag, f"{flag} {text}: give HOST:PORT (node 0's address)")
    return host.strip("[]"), int(port)


def first_host(nodelist):
    """The first host of a Slurm node list: 'gpu[03-05,9],cpu1' -> 'gpu03'. Slurm's own
    ``scontrol show hostnames`` says it where it is installed; elsewhere (a test, a
    container without Slurm's tools) the list's first range is read here."""
    import subprocess
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                              text=True, timeout=10)
        if done.returncode == 0 and done.stdout.split():
            return done.stdout.split()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return _first_in_list(nodelist)


def _first_in_list(nodelist):
    """first_host without Slurm's tools."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise NodesError("SLURM_JOB_NODELIST", f"SLURM_JOB_NODELIST={nodelist!r}: no host")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(env, name):
    try:
        return int(env[name])
    except ValueError:
        raise NodesError(name, f"{name}={env[name]!r} is not a number") from None


def _slurm(env):
    if "SLURM_NODEID" not in env or "SLURM_NNODES" not in env:
        return None
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_STEP_TASKS_PER_NODE", "1")

    def address():
        host = first_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
        # A port of the job's own, so that two jobs sharing node 0 do not clash.
        job = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
        return host, DEFAULT_PORT + job % 1000
    return ("Slurm", "SLURM_NNODES", "SLURM_NODEID", "SLURM_NTASKS_PER_NODE",
            per_node.split("(")[0] or "1", "srun --ntasks-per-node=1", address)


def _open_mpi(env):
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None

    def address():
        # mpirun's own node, where its rank 0 runs unless told otherwise.
        m = re.search(r"tcp6?://\[?([^\]/;,:]+)", env.get("OMPI_MCA_orte_hnp_uri", ""))
        if not m:
            raise NodesError(COORDINATOR_ENV, "under mpirun, give node 0's address: "
                             f"mpirun -x {COORDINATOR_ENV}=HOST:PORT")
        return m.group(1), DEFAULT_PORT
    return ("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
            "mpirun --map-by ppr:1:node", address)


def _torchrun(env):
    if "TORCHELASTIC_RUN_ID" not in env and not ("GROUP_RANK" in env
                                                 and "LOCAL_WORLD_SIZE" in env):
        return None

    def address():
        # torchrun's own store holds MASTER_PORT on node 0: the next port is ours.
        return env["MASTER_ADDR"], _int(env, "MASTER_PORT") + 1
    return ("torchrun", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE",
            env.get("LOCAL_WORLD_SIZE", "1"), "torchrun --nproc-per-node=1", address)


# The job launchers whose variables say where the nodes are, asked in this order: a new one
# is a reader here and its test case (docs/DECISIONS.md, "Extension points").
ENVIRONMENTS = (_slurm, _open_mpi, _torchrun)


def from_environment(env=None):
    """The Nodes a job launcher's variables describe, or None outside one. One launcher per
    node: a job that starts several processes on a node is refused, saying how to start
    one."""
    env = os.environ if env is None else env
    for read in ENVIRONMENTS:
        found = read(env)
        if found is None:
            continue
        source, size, rank, per_node_var, per_node, how, address = found
        if per_node != "1":
            raise NodesError(per_node_var, f"{source} starts {per_node} processes a node; "
                             f"pympgu starts each node's workers itself: {how}")
        coordinator = env.get(COORDINATOR_ENV)
        host, port = _address(coordinator, COORDINATOR_ENV) if coordinator else address()
        return Nodes(_int(env, size), _int(env, rank), host, port, source).check()
    return None


def resolve(nnodes=None, node_rank=None, coordinator=None, env=None):
    """This launcher's Nodes: from the flags where given (all three, or --nnodes 1), else
    from a job launcher's environment, else one node."""
    if nnodes is None and node_rank is None and coordinator is None:
        return from_environment(env) or Nodes()
    if nnodes is None:
        raise NodesError("--nnodes", "--node-rank and --coordinator need --nnodes")
    if nnodes == 1:
        if node_rank not in (None, 0):
            raise NodesError("--node-rank", "--node-rank must be 0 with --nnodes 1")
        return Nodes(1, 0, *(_address(coordinator, "--coordinator") if coordinator else
                             ("127.0.0.1", DEFAULT_PORT))).check()
    if node_rank is None or coordinator is None:
        raise NodesError("--node-rank" if node_rank is None else "--coordinator",
                         "--nnodes N needs --node-rank and --coordinator HOST:PORT too (or a "
                         "job launcher's environment: Slurm, Open MPI, torchrun)")
    host, port = _address(coordinator, "--coordinator")
    return Nodes(nnodes, node_rank, host, port).check()


def read_secret(secret_file=None, env=None):
    """The run's secret, from the file --secret-file names (which must be this user's own,
    and readable by no one else)
    or from $PYMPGU_SECRET; None when neither is given. Never from a command line."""
    env = os.environ if env is None else env
    if secret_file:
        try:
            fd = os.open(secret_file, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise NodesError("--secret-file", f"--secret-file {secret_file}: "
                                              f"{e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NodesError("--secret-file", f"--secret-file {secret_file}: not a "
                                 "regular file")
            if st.st_uid != os.geteuid():
                # Its owner chose the secret, and can read every message sealed with it.
                raise NodesError("--secret-file", f"--secret-file {secret_file}: owned by "
                                 f"uid {st.st_uid}, not by this user (uid {os.geteuid()}): "
                                 "use a file of your own")
            if st.st_mode & 0o077:
                raise NodesError("--secret-file", f"--secret-file {secret_file}: others may "
                                 f"read it (mode {stat.filemode(st.st_mode)}): chmod 600 it")
            secret = os.read(fd, 4096).strip()
        finally:
            os.close(fd)
        where = f"--secret-file {secret_file}"
    elif env.get(SECRET_ENV):
        secret, where = env[SECRET_ENV].encode(), f"${SECRET_ENV}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise NodesError("--secret-file" if secret_file else SECRET_ENV,
                         f"{where} holds {len(secret)} bytes; give at least "
                         f"{MIN_SECRET_BYTES} random ones (openssl rand -hex 32)")
    return secret
