"""A local sandbox for code the policy wrote: each run is a separate process tree in new
namespaces, with resource limits, a private working directory and a deadline.

What one :meth:`Sandbox.run` gets (the launcher, :mod:`grpo_plugins.rewards.sandbox_child`,
sets it up in the child processes):

- **a file system of its own**: a root built for the run and entered with ``pivot_root``,
  holding read-only the system's programs and libraries (``/usr``, ``/bin``, ``/sbin``,
  ``/lib*``, ``/etc/ld.so.cache``) and the interpreter's own files (its executable, its
  ``pyvenv.cfg``, its library folder and its site-packages, the links that lead to them); a
  minimal ``/dev`` (``null``, ``zero``, ``full``, ``random``, ``urandom``, a ``/dev/shm``
  tmpfs); the ``/proc`` of its PID namespace; and ``/sandbox``, its working directory: a
  tmpfs of ``disk_bytes`` holding the files the caller gave, gone when the run ends. No other
  host file, folder or UNIX socket is in it: not the data, the home folder, ``/tmp``,
  ``/run``, ``/var`` or the rest of ``/etc``;
- **no network**: a new network namespace, whose only interface (loopback) is down (so no
  abstract UNIX socket of the host either);
- **its own processes only**: a new PID namespace; when the run ends or its deadline passes,
  the launcher's process group is killed, the namespace's first process dies with it and the
  kernel kills every process left in the namespace, including those that started a session
  of their own;
- **limits**: CPU seconds, address space, processes, the size of a written file, open files,
  no core dump; the wall-clock deadline; the first ``output_bytes`` of its output are read,
  after which the pipe is closed;
- **a clean environment**: ``PATH``, ``HOME`` and ``TMPDIR`` (the working directory), a
  locale and single-threaded math libraries, nothing of the trainer's environment;
- **an identity that owns nothing of the host**: when the trainer runs as root, an
  unprivileged user id (``uid_base`` plus an offset per trainer process and the worker's
  index, so concurrent runs never share a process count); otherwise a user namespace of its
  own in which no user id is mapped (it is ``nobody`` there and cannot make further user
  namespaces); in both cases without the means to gain privileges (``PR_SET_NO_NEW_PRIVS``).

Where namespaces cannot be made (a container without the permission), the sandbox refuses
to start unless ``trusted_host`` says the code may run without them; it then still gets the
limits, the environment and the deadline, and every process it starts is killed at the end
(the launcher is their subreaper), but it shares the network, the process table and the file
system (guides/trust.md says what that means).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_core.errors import RunError

__all__ = ["Limits", "Outcome", "Sandbox", "SandboxFailure"]

log = logging.getLogger("grpo.sandbox")

LAUNCHER = Path(__file__).with_name("sandbox_child.py")
SETUP_FAILED = 97  # the launcher's exit code when the code did not start (sandbox_child.SETUP_FAILED)
# how the launcher's messages about a failed isolation step start (sandbox_child.ISOLATION_STEPS)
ISOLATION_STEPS = ("unshare", "mounting", "binding", "making", "pivot_root", "detaching", "building the root")
WORKDIR = "/sandbox"  # the code's working directory in its own root (sandbox_child.WORKDIR)
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
_ASK_FILES = (  # run by the interpreter: the files it needs (not what a .pth file adds to sys.path)
    "import json, os, site, sys, sysconfig\n"
    "paths = [sysconfig.get_config_var('LIBDIR'), *site.getsitepackages(),\n"
    "         *(sysconfig.get_path(k) for k in ('stdlib', 'platstdlib', 'purelib', 'platlib'))]\n"
    "cfg = os.path.join(sys.prefix, 'pyvenv.cfg')\n"
    "print(json.dumps([sys.executable, *(p for p in paths if p), *([cfg] if os.path.isfile(cfg) else [])]))"
)
REPORT_BYTES = 1 << 20  # the most read of what the code writes on its report descriptor
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
}


class SandboxFailure(RunError):
    """The sandbox itself could not run the code (not the code's fault): a namespace, a mount,
    the interpreter. Its message says what failed."""


@dataclass(frozen=True)
class Limits:
    """What one run may use: ``wall_s`` seconds in all, ``cpu_s`` CPU seconds per process,
    ``memory_bytes`` of address space per process, ``processes`` (threads count) for its
    user, ``file_bytes`` per written file, ``disk_bytes`` in its working directory,
    ``output_bytes`` of stdout and stderr read, ``open_files`` descriptors per process."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    processes: int = 16
    file_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    output_bytes: int = 1 << 16
    open_files: int = 64


@dataclass(frozen=True)
class Outcome:
    """How a run ended: the exit code (128 + N for signal N; None when it was killed at the
    deadline), its stdout and stderr (the first ``output_bytes`` of each; ``output_cut`` when
    stdout had more) and what it wrote on the report descriptor (the first
    :data:`REPORT_BYTES`)."""

    exit_code: int | None
    output: bytes
    errors: bytes = b""
    report: bytes = b""
    output_cut: bool = False

    @property
    def timed_out(self) -> bool:
        return self.exit_code is None


class Sandbox:
    """Runs programs under the guarantees of the module doc, ``workers`` at a time (each
    caller of :meth:`run` takes a worker slot, waiting for one when all are busy).

    ``python``: the interpreter the code runs with; None: this process's, or when the code's
    user cannot run it (an interpreter under ``/root``), the system's ``python3``.
    Made once per run: it checks that the namespaces can be made and the interpreter runs
    (a :class:`SandboxFailure` saying what to change if not)."""

    def __init__(self, limits: Limits, *, workers: int = 1, python: str | None = None, trusted_host: bool = False,
                 uid_base: int = 1_900_000_000):
        if not 1 <= workers <= 64:
            raise ValueError(f"a sandbox runs 1 to 64 workers, got {workers}")
        self.limits = limits
        self.root = os.geteuid() == 0
        self.uid_base = uid_base
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(workers):
            self._slots.put(slot)
        self.isolate = True
        self._files: dict[str, tuple[list[str], dict[str, str]]] = {}
        failure = self._probe(python or sys.executable)
        if failure is not None and failure.startswith(ISOLATION_STEPS):
            if not trusted_host:
                raise SandboxFailure(
                    "code sandbox: this host cannot make the namespaces and mounts that cut the code off the "
                    f"network and the host's processes and files ({failure}). Run where unshare(2) and mount(2) "
                    "are allowed (a root container, or a kernel with unprivileged user namespaces); or set the "
                    "code_tests option `sandbox_url` to a Sandbox Fusion server's URL to run the code there; or set "
                    "`trusted_host: true` to run it here without namespaces (limits, a clean environment and the "
                    "deadline still apply, but the code sees the network, the processes and the files of the user "
                    "it runs as; guides/trust.md)"
                )
            log.warning("code sandbox: namespaces unavailable (%s); trusted_host is set, so the code runs "
                        "without them: it can reach the network and read and write what its user can", failure)
            self.isolate = False
            failure = self._probe(python or sys.executable)
        if failure is not None and python is None and self.root and shutil.which("python3", path=ENV["PATH"]):
            fallback = shutil.which("python3", path=ENV["PATH"])
            if self._probe(fallback) is None:
                log.warning("code sandbox: its user cannot run %s (%s); the code runs with %s (set the `python` "
                            "option to choose)", sys.executable, failure, fallback)
                python, failure = fallback, None
        if failure is not None:
            raise SandboxFailure(f"code sandbox: cannot run the code's interpreter {python or sys.executable}: "
                                 f"{failure}; set the `python` option to an interpreter its user can run")
        self.python = python or sys.executable

    def uid(self, slot: int) -> int:
        """The user id of worker ``slot``'s code (when the trainer is root): one per trainer
        process and worker, so no two runs share a process count or can signal each other."""
        return self.uid_base + (os.getpid() % 65536) * 64 + slot

    def _probe(self, python: str) -> str | None:
        """None when ``python`` starts in the sandbox, else what failed."""
        try:
            outcome = self._run({}, [python, "-I", "-c", "print('ready')"], None, python)
        except SandboxFailure as exc:
            return str(exc)
        if outcome.exit_code != 0 or b"ready" not in outcome.output:
            text = (outcome.output + outcome.errors).decode("utf-8", "replace").strip()[-300:]
            return f"exit code {outcome.exit_code}: {text or '(no output)'}"
        return None

    # ----------------------------------------------------------------- running
    def run(self, files: dict[str, str], argv: list[str], stdin: str | None = None) -> Outcome:
        """Run ``argv`` (``{python}`` in it is the sandbox's interpreter) in a fresh working
        directory holding ``files`` (name -> text), with ``stdin`` as its standard input.
        The program may write a report on the descriptor whose number is in the environment
        variable ``GRPO_REPORT_FD``. A :class:`SandboxFailure` when the sandbox could not
        start it; whatever the code does is in the :class:`Outcome`."""
        argv = [self.python if part == "{python}" else part for part in argv]
        return self._run(files, argv, stdin, self.python)

    def interpreter_files(self, python: str) -> tuple[list[str], dict[str, str]]:
        """What the code's root holds for ``python`` to run: the host paths bound read-only
        (the system's, the interpreter's) and the symbolic links on the way to them (path ->
        target). Asked of the interpreter once (a :class:`SandboxFailure` if it cannot say)."""
        if python not in self._files:
            try:
                done = subprocess.run([python, "-I", "-c", _ASK_FILES], capture_output=True, env={}, timeout=60,
                                      stdin=subprocess.DEVNULL, check=True)
                wanted = [python, *json.loads(done.stdout)]
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", b"") or b""
                raise SandboxFailure(f"cannot ask the interpreter {python} where its files are: {exc} "
                                     f"{detail.decode('utf-8', 'replace')[-300:]}".strip()) from None
            binds, links = [], {}
            for path in [*SYSTEM, *wanted]:
                if os.path.lexists(path):
                    binds.append(_resolve(os.path.abspath(path), links))
            if "/" in binds:  # the host's whole root would be in the code's: no interpreter needs that
                raise SandboxFailure(f"code sandbox: the interpreter {python} names / as one of its folders "
                                     "(its LIBDIR, stdlib or site-packages); set the `python` option to another")
            self._files[python] = (sorted(set(binds)), links)
        return self._files[python]

    def _run(self, files: dict[str, str], argv: list[str], stdin: str | None, python: str) -> Outcome:
        binds, links = self.interpreter_files(python) if self.isolate else ([], {})
        slot = self._slots.get()
        workdir = Path(tempfile.mkdtemp(prefix="grpo-sandbox-"))
        fds: list[int] = []
        proc = None
        try:
            for name, text in files.items():
                (workdir / name).write_text(text, encoding="utf-8")
            if stdin is not None:
                (workdir / ".stdin").write_text(stdin, encoding="utf-8")
            uid = self.uid(slot) if self.root else None
            if uid is not None and not self.isolate:
                os.chown(workdir, uid, uid)
            report_r, report_w = os.pipe()
            setup_r, setup_w = os.pipe()
            fds += [report_r, report_w, setup_r, setup_w]
            home = WORKDIR if self.isolate else str(workdir)
            config = {
                "isolate": self.isolate, "workdir": str(workdir), "uid": uid, "gid": uid,
                "binds": binds, "links": links,
                "limits": {"cpu": self.limits.cpu_s, "memory": self.limits.memory_bytes,
                           "processes": self.limits.processes, "file_size": self.limits.file_bytes,
                           "open_files": self.limits.open_files, "core": 0},
                "disk_bytes": self.limits.disk_bytes, "argv": argv, "setup_fd": setup_w,
                "env": {**ENV, "HOME": home, "TMPDIR": home, "GRPO_REPORT_FD": str(report_w)},
            }
            deadline = time.monotonic() + self.limits.wall_s
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(config)], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(report_w, setup_w),
                start_new_session=True, env={}, cwd="/",
            )
            for fd in (report_w, setup_w):
                os.close(fd)
                fds.remove(fd)
            output, errors, report, cut = _collect(proc, report_r, deadline, self.limits.output_bytes)
            exit_code = _wait(proc, deadline)
            if exit_code is None:
                _end(proc)
            setup = _read_available(setup_r, 4096)
            if exit_code == SETUP_FAILED and setup:
                raise SandboxFailure(setup.decode("utf-8", "replace"))
            return Outcome(exit_code, output, errors, report, cut)
        finally:
            if proc is not None:
                _kill_group(proc)
                proc.wait()
                proc.stdout.close()
                proc.stderr.close()
            for fd in fds:
                os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)
            self._slots.put(slot)


def _resolve(path: str, links: dict[str, str]) -> str:
    """``path`` with every symbolic link on the way resolved (each recorded in ``links``)."""
    todo = [part for part in reversed(path.split("/")) if part not in ("", ".")]
    current, hops = "/", 0
    while todo:
        part = todo.pop()
        if part == "..":
            current = os.path.dirname(current)
            continue
        step = os.path.join(current, part)
        if not os.path.islink(step):
            current = step
            continue
        hops += 1
        if hops > 40:
            raise SandboxFailure(f"code sandbox: too many symbolic links on the way to {path}")
        target = os.readlink(step)
        links[step] = target
        todo.extend(part for part in reversed(target.split("/")) if part not in ("", "."))
        if target.startswith("/"):
            current = "/"
    return current


def _collect(proc: subprocess.Popen, report_fd: int, deadline: float, output_bytes: int
             ) -> tuple[bytes, bytes, bytes, bool]:
    """Read the program's stdout, stderr and report until they close, the launcher exits (with
    a moment for what is in flight) or the deadline passes. Beyond ``output_bytes`` a stream's
    pipe is closed (the program's next write to it fails)."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    streams = {out_fd: proc.stdout, err_fd: proc.stderr, report_fd: None}
    buffers = {fd: bytearray() for fd in streams}
    caps = {fd: output_bytes if stream is not None else REPORT_BYTES for fd, stream in streams.items()}
    cut = False
    exited_at = None
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline or (exited_at is not None and now - exited_at > 0.2):
                break
            if exited_at is None and _exited(proc):
                exited_at = now
            for key, _ in selector.select(min(0.1, deadline - now)):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                room = caps[key.fd] - len(buffers[key.fd])
                buffers[key.fd] += data[:room]
                if not data or len(data) > room:
                    selector.unregister(key.fd)
                    if data and streams[key.fd] is not None:
                        cut = cut or key.fd == out_fd
                        streams[key.fd].close()
    return bytes(buffers[out_fd]), bytes(buffers[err_fd]), bytes(buffers[report_fd]), cut


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the launcher has exited, without reaping it (its process group id stays ours
    to kill until then)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _wait(proc: subprocess.Popen, deadline: float) -> int | None:
    """The launcher's exit code once it exits (not reaped), or None at the deadline."""
    while not _exited(proc):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)
    found = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if found is None:  # reaped elsewhere (cannot happen: only this thread waits for it)
        return proc.wait()
    return found.si_status if found.si_code == os.CLD_EXITED else 128 + found.si_status


def _end(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """At the deadline: ask the launcher to kill the run and wait for its namespace to empty
    (SIGTERM), then SIGKILL its whole process group if it has not exited within ``grace``."""
    try:
        os.kill(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    until = time.monotonic() + grace
    while not _exited(proc) and time.monotonic() < until:
        time.sleep(0.005)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group (the launcher is not reaped yet, so the id is still
    its group's)."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_available(fd: int, limit: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit)
    except BlockingIOError:
        return b""
