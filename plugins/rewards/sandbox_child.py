"""The sandbox's launcher: run as ``python -I -S sandbox_child.py CONFIG`` by
:mod:`grpo_plugins.rewards.sandbox`, never imported. Standard library only.

What it does, in order (``CONFIG`` is a JSON object; see :func:`main`):

1. With ``isolate``: ``unshare`` new network, PID, mount, IPC and UTS namespaces (and a user
   namespace that maps the caller's own user id when the caller is not root). The network
   namespace holds only a loopback interface that is down: no connection leaves it, and no
   abstract UNIX socket of the host is reachable.
2. Forks the namespace's first process (its ``init``, PID 1). At the deadline the caller sends
   the launcher SIGTERM: it kills init and waits for it, and when init dies the kernel kills
   every process left in the PID namespace (those that left the process group with
   ``setsid`` too) before init's exit completes, so the launcher's exit means nothing of the
   run is left. init also dies with the launcher (``PR_SET_PDEATHSIG``), should the caller
   have to kill the launcher's process group outright. Without ``isolate`` there is no such
   namespace: the launcher is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every process
   of the run whose parent dies becomes its child, and when the run ends or the deadline
   passes it kills every descendant it can find in ``/proc`` and reaps them until it has no
   child left.
3. With ``isolate``, init builds the code's root and enters it (:func:`build_root`): a fresh
   tmpfs holding read-only binds of ``binds`` (the system's programs and libraries, the
   interpreter's files) and the symbolic links ``links`` leading to them, a minimal ``/dev``,
   a ``/proc`` of the namespace and ``/sandbox``, a tmpfs of ``disk_bytes`` holding the
   files the caller wrote in ``workdir``; then ``pivot_root`` into it and detaches the old
   root, so nothing else of the host's file system is reachable, and makes every mount but
   ``/sandbox`` and ``/dev/shm`` read-only. init is not dumpable: the code cannot trace it
   or open its ``/proc`` entries. In both cases init joins a new, empty session keyring: the
   keys of the trainer's session are out of the code's reach.
4. The worker sets its resource limits (CPU seconds, address space, processes, file size,
   open files, no core dumps), enters the working directory, drops to ``uid``/``gid`` when
   the caller is root, and (with ``isolate``) enters a user namespace of its own in which no
   user id is mapped: the code is ``nobody`` there, holds no capability, and cannot make a
   user namespace (in which it would hold some). Under a root caller that last step may fail
   only where the host lets no unprivileged user make one, the code included. It forbids
   gaining privileges
   (``PR_SET_NO_NEW_PRIVS``: no setuid binary helps), and ``execve``s ``argv`` with ``env``
   as its whole environment, its stdin a memory file holding ``workdir/.stdin`` (or
   ``/dev/null``).

The launcher exits with the worker's exit code, or 128 + the signal that killed it. A step
that fails before the code starts writes ``what failed`` on the descriptor ``setup_fd`` and
exits :data:`SETUP_FAILED`; a failure of the isolation itself starts with one of
:data:`ISOLATION_STEPS` (the caller's sign that the host cannot isolate). The worker closes
that descriptor as it starts the code (close-on-exec), so the code cannot forge a failure of
the sandbox.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys
import time

SETUP_FAILED = 97
ISOLATION_STEPS = ("unshare", "mounting", "binding", "making", "pivot_root", "detaching", "building the root")
WORKDIR = "/sandbox"  # the code's working directory in its own root

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217,
                  "i686": 217, "i386": 217, "armv7l": 218, "armv8l": 218}
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 280, "ppc64": 280, "s390x": 280,
              "i686": 288, "i386": 288, "armv7l": 311, "armv8l": 311}
KEYCTL_JOIN_SESSION_KEYRING = 1
DEVICES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
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
    """(mount point, flags to keep, read-only) of every mount, parents first."""
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


def under(path, folders):
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def mount_point(new_root, path, is_dir):
    """An empty directory (or file) at ``path`` in the new root, its missing parents 0755."""
    target = new_root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if is_dir:
        os.makedirs(target, mode=0o755, exist_ok=True)
    elif not os.path.exists(target):
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    return target


def bind_read_only(new_root, path):
    """``path`` of the host at the same place in the new root, read-only, no setuid, no devices."""
    target = mount_point(new_root, path, os.path.isdir(path))
    check(mount(path, target, None, MS_BIND | MS_REC), f"binding {path}")
    check(mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept_flags(path)),
              f"making {path} read-only")


def kept_flags(path):
    """The flags of the mount holding ``path`` that a remount must keep (the kernel refuses to
    clear the locked ones in a user namespace)."""
    best, flags = "", 0
    for point, point_flags, _ in mounts():
        if under(path, [point]) and len(point) >= len(best):
            best, flags = point, point_flags
    return flags


def make_dev(new_root, disk_bytes):
    """A /dev of its own: the harmless devices bound from the host, the usual links and a
    /dev/shm tmpfs."""
    dev = mount_point(new_root, "/dev", True)
    check(mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755"), "mounting /dev")
    for name in DEVICES:
        target = mount_point(new_root, f"/dev/{name}", False)
        check(mount(f"/dev/{name}", target, None, MS_BIND), f"binding /dev/{name}")
    for name, link in DEV_LINKS.items():
        os.symlink(link, f"{dev}/{name}")
    shm = mount_point(new_root, "/dev/shm", True)
    check(mount("tmpfs", shm, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_bytes},mode=1777"), "mounting /dev/shm")


def build_root(config, owner):
    """The code's whole file system (module doc, step 3); returns the bytes of its stdin."""
    stage, files, stdin = config["workdir"], {}, None
    for name in os.listdir(stage):
        with open(os.path.join(stage, name), "rb") as fh:
            if name == ".stdin":
                stdin = fh.read()
            else:
                files[name] = fh.read()
    os.umask(0o022)
    check(mount(None, "/", None, MS_REC | MS_PRIVATE), "making the mounts private")
    check(mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755"),
              "mounting the new root")
    binds = sorted(config["binds"])
    done = []
    for path in binds:
        if not under(path, done):
            bind_read_only(stage, path)
            done.append(path)
    for path, link in sorted(config["links"].items()):
        if not under(path, done) and not os.path.lexists(stage + path):
            mount_point(stage, os.path.dirname(path), True)
            os.symlink(link, stage + path)
    check(mount("proc", mount_point(stage, "/proc", True), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC),
              "mounting /proc")
    make_dev(stage, config["disk_bytes"])
    work = mount_point(stage, WORKDIR, True)
    size = f"size={config['disk_bytes']},mode=0700,uid={owner[0]},gid={owner[1]}"
    check(mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, size), "mounting the working directory")
    for name, data in files.items():
        with open(os.path.join(work, name), "wb") as fh:
            fh.write(data)
    enter_root(stage)
    return stdin


def enter_root(new_root):
    """``pivot_root`` into ``new_root``, detach the old root, make every mount but the
    writable ones read-only."""
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        fail(f"pivot_root: no system call number known for {platform.machine()}")
    os.chdir(new_root)
    check(_libc.syscall(number, b".", b"."), "pivot_root into the new root")
    check(_libc.umount2(b".", MNT_DETACH), "detaching the host's root")
    os.chdir("/")
    for point, flags, read_only in mounts():
        if read_only or under(point, ["/proc", WORKDIR, "/dev/shm"]) or point.startswith("/dev/") and \
                point[5:] in DEVICES:
            continue
        check(mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags), f"making {point} read-only")


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


def read_stdin(config):
    """The bytes of the code's stdin, read from the host (without ``isolate``)."""
    path = os.path.join(config["workdir"], ".stdin")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as fh:
        return fh.read()


def set_stdin(data):
    """Standard input: a memory file holding ``data`` (nothing of the host), or /dev/null."""
    if data is None:
        fd = os.open("/dev/null", os.O_RDONLY)
    else:
        fd = os.memfd_create("stdin", 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)


def worker(config, root, stdin):
    set_stdin(stdin)
    set_limits(config["limits"])
    os.chdir(WORKDIR if config["isolate"] else config["workdir"])
    if root and config.get("uid") is not None:
        try:
            os.setgroups([])
            os.setgid(config["gid"])
            os.setuid(config["uid"])
        except OSError as exc:
            fail(f"dropping to user {config['uid']} failed: {exc}")
    if config["isolate"] and _libc.unshare(CLONE_NEWUSER) != 0 and not root:
        check(-1, "unshare (the code's own user namespace)")
    check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.set_inheritable(_setup_fd, False)  # closed when the code starts
    argv = config["argv"]
    try:
        os.execve(argv[0], argv, config["env"])
    except OSError as exc:
        fail(f"cannot run {argv[0]}: {exc}")


def new_session_keyring():
    """An empty session keyring of its own: the keys of the caller's session (which their
    possessor can read whatever its user id) stay out of reach. Nothing to do where the kernel
    has no keyrings (ENOSYS) or a seccomp filter denies ``keyctl`` (EPERM, as container
    runtimes' default profiles do): the code inherits that filter and cannot reach them either."""
    number = SYS_KEYCTL.get(platform.machine())
    if number is None:
        fail(f"keyctl: no system call number known for {platform.machine()}")
    if _libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None) < 0 and ctypes.get_errno() not in (1, 38):
        check(-1, "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")


def status_code(status):
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def init(config, root, launcher):
    """PID 1 of the namespace (or a plain child without ``isolate``): the code's root, then the
    worker, reaping every orphan until the worker ends."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    new_session_keyring()
    if config["isolate"]:
        try:
            stdin = build_root(config, owner(config, root))
        except OSError as exc:
            fail(f"building the root: {exc}")
    else:
        stdin = read_stdin(config)
        if os.getppid() != launcher:
            os._exit(SETUP_FAILED)  # the launcher died before the death signal was armed
    child = os.fork()
    if child == 0:
        worker(config, root, stdin)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        if pid == child:
            os._exit(status_code(status))


def descendants(ancestor):
    """The processes below ``ancestor``, from each one's parent in /proc/PID/stat."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                parent = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(name))
    found, todo = [], [ancestor]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def kill_descendants():
    """Kill every process below this one (a subreaper: orphans of the run are its children)
    and reap them until none is left. A process forked meanwhile has a parent being killed,
    so it becomes a child of this one and the next round finds it."""
    me = os.getpid()
    while True:
        for pid in descendants(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.002)


def main():
    global _setup_fd
    config = json.loads(sys.argv[1])
    _setup_fd = config.get("setup_fd", 2)
    root = os.geteuid() == 0
    if config["isolate"]:
        enter_namespaces(root)
    else:
        check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    launcher = os.getpid()
    child = None

    def end(signum, frame):  # the deadline: kill init (and with it, or after it, the rest)
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass

    signal.signal(signal.SIGTERM, end)
    child = os.fork()
    if child == 0:
        try:
            init(config, root, launcher)
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the code did not start
            fail(f"{type(exc).__name__}: {exc}")
    while True:
        pid, status = os.waitpid(-1 if not config["isolate"] else child, 0)
        if pid == child:
            child = None
            break
    if not config["isolate"]:
        kill_descendants()
    sys.exit(status_code(status))


if __name__ == "__main__":
    main()
