"""The sandbox's launcher: run as ``python -I -S sandbox_child.py CONFIG`` by
:mod:`grpo_plugins.rewards.sandbox`, never imported. Standard library only.

What it does, in order (``CONFIG`` is a JSON object; see :func:`main`):

1. With ``isolate``: ``unshare`` new network, PID, mount, IPC and UTS namespaces (and a user
   namespace that maps the caller's own user id when the caller is not root). The network
   namespace holds only a loopback interface that is down: no connection leaves it.
2. Forks the namespace's first process (its ``init``, PID 1). At the deadline the caller sends
   the launcher SIGTERM: it kills init and waits for it, and when init dies the kernel kills
   every process left in the PID namespace (those that left the process group with
   ``setsid`` too) before init's exit completes, so the launcher's exit means nothing of the
   run is left. init also dies with the launcher (``PR_SET_PDEATHSIG``), should the caller
   have to kill the launcher's process group outright.
3. init mounts a fresh ``/proc`` (only the namespace's processes are visible), puts a tmpfs
   of ``disk_bytes`` on the working directory (holding a copy of the files the caller wrote
   there, gone with the namespace), makes every other mount read-only, and forks the worker.
4. The worker sets its resource limits (CPU seconds, address space, processes, file size,
   open files, no core dumps), enters the working directory, drops to ``uid``/``gid`` when
   the caller is root, forbids gaining privileges (``PR_SET_NO_NEW_PRIVS``: no setuid
   binary helps), and ``execve``s ``argv`` with ``env`` as its whole environment, its stdin
   the file ``stdin`` (or ``/dev/null``).

The launcher exits with the worker's exit code, or 128 + the signal that killed it. A step
that fails before the code starts writes ``what failed`` on the descriptor ``setup_fd`` and
exits :data:`SETUP_FAILED`; the worker closes that descriptor as it starts the code
(close-on-exec), so the code cannot forge a failure of the sandbox.
"""

import ctypes
import json
import os
import resource
import signal
import sys

SETUP_FAILED = 97

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

LIMITS = {"cpu": resource.RLIMIT_CPU, "memory": resource.RLIMIT_AS, "processes": resource.RLIMIT_NPROC,
          "file_size": resource.RLIMIT_FSIZE, "open_files": resource.RLIMIT_NOFILE, "core": resource.RLIMIT_CORE}

_libc = ctypes.CDLL(None, use_errno=True)


_setup_fd = 2


def fail(what):
    try:
        os.write(_setup_fd, what.encode())
    finally:
        os._exit(SETUP_FAILED)


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        fail(f"{what} failed: {os.strerror(err)} (errno {err})")


def _bytes(text):
    return None if text is None else text.encode()


def mount(source, target, fstype, flags, data=None):
    encode = _bytes
    return _libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data))


def write_file(path, text):
    with open(path, "w") as fh:
        fh.write(text)


def enter_namespaces(root):
    """New namespaces for what follows; a user namespace mapping this user when not root."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
    if not root:
        flags |= CLONE_NEWUSER
    check(_libc.unshare(flags), "unshare (new namespaces)")
    if not root:
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        write_file("/proc/self/gid_map", f"{gid} {gid} 1")


def unescape(field):
    """A mount point as /proc/self/mountinfo writes it (octal escapes for blanks)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts():
    """(mount point, flags to keep) of every mount, parents first."""
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            options = fields[5].split(",")
            flags = 0
            for option in options:
                flags |= MOUNT_FLAGS.get(option, 0)
            if not flags & (MS_NOATIME | MS_RELATIME):
                flags |= MS_STRICTATIME
            found.append((unescape(fields[4]), flags, "ro" in options))
    return found


def private_mounts(config, owner):
    """A fresh /proc, a tmpfs of ``disk_bytes`` on the working directory holding its files,
    every other mount read-only."""
    workdir = config["workdir"]
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as fh:
            files[name] = fh.read()
    check(mount(None, "/", None, MS_REC | MS_PRIVATE), "making the mounts private")
    check(mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC), "mounting /proc")
    size = f"size={config['disk_bytes']},mode=0700,uid={owner[0]},gid={owner[1]}"
    check(mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, size), "mounting the working directory")
    for name, data in files.items():
        with open(os.path.join(workdir, name), "wb") as fh:
            fh.write(data)
    for point, flags, read_only in mounts():
        if point == workdir or read_only:
            continue
        if mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags) != 0:
            err = ctypes.get_errno()
            if err in (2, 13) and point != "/":  # a mount point hidden or unreachable from here
                continue
            fail(f"making {point} read-only failed: {os.strerror(err)} (errno {err})")


def set_limits(limits):
    for name, value in limits.items():
        hard = value + 1 if name == "cpu" else value  # SIGXCPU at the soft limit, SIGKILL a second later
        try:
            resource.setrlimit(LIMITS[name], (value, hard))
        except (ValueError, OSError) as exc:
            fail(f"setting the {name} limit to {value} failed: {exc}")


def owner(config, root):
    """The user and group the code runs as: ``uid``/``gid`` when the caller is root, else the caller."""
    if root and config.get("uid") is not None:
        return config["uid"], config["gid"]
    return os.getuid(), os.getgid()


def worker(config, root):
    set_limits(config["limits"])
    os.chdir(config["workdir"])
    if root and config.get("uid") is not None:
        try:
            os.setgroups([])
            os.setgid(config["gid"])
            os.setuid(config["uid"])
        except OSError as exc:
            fail(f"dropping to user {config['uid']} failed: {exc}")
    check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.set_inheritable(_setup_fd, False)  # closed when the code starts
    stdin = os.open(config.get("stdin") or "/dev/null", os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    argv = config["argv"]
    try:
        os.execve(argv[0], argv, config["env"])
    except OSError as exc:
        fail(f"cannot run {argv[0]}: {exc}")


def status_code(status):
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def init(config, root, launcher):
    """PID 1 of the namespace (or a plain child without ``isolate``): the mounts, then the
    worker, reaping every orphan until the worker ends."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if config["isolate"]:
        private_mounts(config, owner(config, root))
    if os.getppid() != launcher and not config["isolate"]:
        os._exit(SETUP_FAILED)  # the launcher died before the death signal was armed
    child = os.fork()
    if child == 0:
        worker(config, root)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        if pid == child:
            os._exit(status_code(status))


def main():
    global _setup_fd
    config = json.loads(sys.argv[1])
    _setup_fd = config.get("setup_fd", 2)
    root = os.geteuid() == 0
    if config["isolate"]:
        enter_namespaces(root)
    launcher = os.getpid()
    signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(child, signal.SIGKILL))
    child = os.fork()
    if child == 0:
        try:
            init(config, root, launcher)
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the code did not start
            fail(f"{type(exc).__name__}: {exc}")
    _, status = os.waitpid(child, 0)
    sys.exit(status_code(status))


if __name__ == "__main__":
    main()
