"""What the code of the ``code_tests`` sandbox can see of the host (issue 47), one test per
sentence of the sandbox section of ``docs/guides/trust.md``: its own root of read-only system
and interpreter files, a private working folder, a minimal /dev and its own /proc; not the
training data, a host UNIX socket or the trainer's user's secrets, whoever runs the trainer;
every process killed at the deadline in ``trusted_host`` mode too; a refusal that names the
real options where the host makes no namespaces.

Each attack is real code run in the real sandbox. "The host makes no namespaces" is a real
such host too: the trainer side runs under a seccomp filter that denies ``unshare(2)`` with
EPERM, as a container runtime's default profile does. "An unprivileged trainer" is the
trainer side run as user 65534 (``setpriv``), which needs root here; those tests are skipped
for a non-root tester.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
from grpo_plugins.rewards.code import CodeTests, CodeTestsOptions
from grpo_plugins.rewards.sandbox import Limits, Sandbox

REPO = Path(__file__).resolve().parents[3]
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="runs the trainer side as another user: needs root")
seccomp_arch = pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"),
                                  reason="the seccomp filter of these tests knows x86_64 and aarch64 only")


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.fixture
def open_dir():
    """A folder any user can traverse and read (0755 under /tmp), unlike pytest's tmp_path
    (under a 0700 folder): what the code meets in it, it meets because the sandbox shows it."""
    path = Path(tempfile.mkdtemp(prefix="grpo-host-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class UnixListener:
    """A UNIX socket server at ``path`` that records every byte it receives."""

    def __init__(self, path: Path | str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.received = b""
        self.accepted = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.settimeout(1)
            try:
                self.received += conn.recv(1024)
            except OSError:
                pass
            conn.close()

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


def run_json(box: Sandbox, code: str) -> dict:
    outcome = box.run({"probe.py": code}, ["{python}", "-I", "probe.py"])
    assert outcome.exit_code == 0, outcome.errors.decode()[-2000:]
    return json.loads(outcome.output)


# ------------------------------------------------------------------ what the code sees
VIEW = r"""
import json, os
def entries(path):
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return type(exc).__name__
def writable(path):
    try:
        with open(os.path.join(path, 'w.txt'), 'w') as fh:
            fh.write('x')
        os.remove(os.path.join(path, 'w.txt'))
        return True
    except OSError:
        return False
print(json.dumps({
    "root": entries("/"), "etc": entries("/etc"), "dev": entries("/dev"), "cwd": os.getcwd(),
    "work": entries("."), "pids": [p for p in entries("/proc") if p.isdigit()],
    "writable": {p: writable(p) for p in ["/", "/usr", "/etc", "/dev", "/proc", ".", "/dev/shm"]},
    "home": os.environ.get("HOME"), "tmp": os.environ.get("TMPDIR"),
    "null": open("/dev/null", "w").write("x"), "random": len(open("/dev/urandom", "rb").read(8)),
    "trainer_cwd": os.path.exists(TRAINER_CWD),
}))
"""

IDENTITY = r"""
import ctypes, json, os
def attempt(action):
    try:
        action()
        return "done"
    except OSError as exc:
        return type(exc).__name__
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "caps": int(status["CapEff"], 16),
    "userns": ctypes.CDLL(None).unshare(0x10000000),
    "init_environ": attempt(lambda: open("/proc/1/environ").read()),
    "init_root": attempt(lambda: os.listdir("/proc/1/root")),
    "init_signal": attempt(lambda: os.kill(1, 9)),
    "init_trace": ctypes.CDLL(None).ptrace(16, 1, 0, 0),  # PTRACE_ATTACH
}))
"""


def test_the_code_sees_its_own_root_of_system_files_interpreter_work_folder_dev_and_proc():
    box = Sandbox(Limits(wall_s=10))
    seen = run_json(box, VIEW.replace("TRAINER_CWD", repr(os.getcwd())))
    interpreter_tops = {Path(p).parts[1] for p in (sys.prefix, sys.base_prefix, os.path.realpath(box.python))}
    system = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "sandbox"}
    assert set(seen["root"]) <= system | interpreter_tops, seen["root"]
    for hidden in ("tmp", "home", "run", "var", "sys", "mnt", "opt", "srv", "boot"):
        if hidden not in interpreter_tops:
            assert hidden not in seen["root"]
    assert seen["etc"] in (["ld.so.cache"], [])  # the loader's cache, nothing else of /etc
    assert set(seen["dev"]) == {"fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout", "urandom", "zero"}
    assert seen["cwd"] == seen["home"] == seen["tmp"] == "/sandbox"
    assert seen["work"] == ["probe.py"]  # only the run's own files
    assert len(seen["pids"]) <= 3 and "1" in seen["pids"]  # its own PID namespace: init, the code
    assert seen["writable"] == {"/": False, "/usr": False, "/etc": False, "/dev": False, "/proc": False,
                                ".": True, "/dev/shm": True}
    assert seen["null"] == 1 and seen["random"] == 8
    assert seen["trainer_cwd"] is False  # the folder the trainer runs in


def test_the_code_is_nobody_without_capabilities_or_user_namespaces_and_cannot_reach_init():
    seen = run_json(Sandbox(Limits(wall_s=10)), IDENTITY)
    assert (seen["uid"], seen["gid"], seen["groups"], seen["caps"]) == (NOBODY, NOBODY, [], 0)
    assert seen["userns"] == -1
    assert seen["init_environ"] == seen["init_root"] == "PermissionError" and seen["init_trace"] == -1
    # refused, or delivered and ignored (init of a PID namespace has no handler for it): the code
    # printed this after the kill, so init and the namespace lived on
    assert seen["init_signal"] in ("PermissionError", "done")


# ------------------------------------------------------------------ item 1: the answers
def test_the_code_cannot_read_the_training_data_so_forging_the_expected_output_scores_0(open_dir):
    rows = [{"prompt": "add", "tests": [{"input": f"{a} {b}\n", "output": f"{a + b}\n"}]}
            for a, b in [(1, 2), (30, 12), (7, 8)]]
    data = open_dir / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data.chmod(0o644)
    (open_dir / "notes.txt").write_text("the answers are in train.jsonl\n")
    (open_dir / "notes.txt").chmod(0o644)
    forger = textwrap.dedent(f"""
        import json, os, sys
        given = sys.stdin.read()
        for folder in [{str(open_dir)!r}, '/tmp', os.getcwd()]:
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                try:
                    lines = open(os.path.join(folder, name)).read().splitlines()
                except OSError:
                    continue
                for line in lines:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    for test in row.get('tests', []):
                        if test['input'] == given:
                            print(test['output'], end='')
                            sys.exit(0)
        print('nothing found')
    """)
    reader = f"print(open({str(open_dir / 'notes.txt')!r}).read(), end='')"
    reward = CodeTests(CodeTestsOptions(workers=2, timeout=6.0))
    notes_test = [{"input": "", "output": "the answers are in train.jsonl"}]
    scores = reward(["p", "p"], [fenced(forger), fenced(reader)], tests=[rows[1]["tests"], notes_test])
    assert scores == [0.0, 0.0]
    honest = "a, b = map(int, input().split())\nprint(a + b)"
    assert reward(["p"], [fenced(honest)], tests=[rows[1]["tests"]]) == [1.0]  # the task itself is scorable


def test_no_expected_output_is_in_what_the_sandbox_is_given():
    """Input/output tests: the code gets its input on stdin and nothing else of the test (the
    comparison with the expected output happens in the trainer): code that prints whatever
    looks like the expected output in its files, environment, arguments or /proc scores 0."""
    dump = textwrap.dedent("""
        import os, re, sys
        found = sys.stdin.read()
        for top, folders, names in os.walk('/'):
            folders[:] = [f for f in folders if f not in ('proc', 'usr', 'dev') and not f.startswith('python3')]
            for name in names:
                try:
                    found += open(os.path.join(top, name), errors='replace').read(1 << 20)
                except OSError:
                    pass
        found += ' '.join(os.environ.values()) + ' '.join(sys.argv)
        for pid in os.listdir('/proc'):
            if pid.isdigit():
                for what in ('cmdline', 'environ'):
                    try:
                        found += open(f'/proc/{pid}/{what}', errors='replace').read()
                    except OSError:
                        pass
        match = re.search('EXPECTED-[0-9a-f]{6}', found)
        print(match.group(0) if match else 'not found')
    """)
    reward = CodeTests(CodeTestsOptions(workers=1, timeout=8.0))
    assert reward(["p"], [fenced(dump)], tests=[[{"input": "4\n", "output": "EXPECTED-7c1e9b"}]]) == [0.0]
    leak = "print('EXPECTED-7c1e9b')"  # the comparison itself works: printing the answer scores 1
    assert reward(["p"], [fenced(leak)], tests=[[{"input": "4\n", "output": "EXPECTED-7c1e9b"}]]) == [1.0]


# ------------------------------------------------------------------ item 2: host sockets
def test_a_world_writable_unix_socket_of_the_host_is_out_of_reach(open_dir):
    path = open_dir / "docker.sock"
    listener = UnixListener(path)
    path.chmod(0o777)
    abstract = UnixListener("\0grpo-sandbox-test-abstract")
    code = textwrap.dedent(f"""
        import json, socket
        result = {{}}
        for name, address in [('file', {str(path)!r}), ('abstract', '\\0grpo-sandbox-test-abstract')]:
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(address)
                s.sendall(b'GET /containers/json HTTP/1.0\\r\\n\\r\\n')
                s.close()
                result[name] = 'connected'
            except OSError as exc:
                result[name] = type(exc).__name__
        print(json.dumps(result))
    """)
    try:
        seen = run_json(Sandbox(Limits(wall_s=10)), code)
    finally:
        listener.close()
        abstract.close()
    assert seen == {"file": "FileNotFoundError", "abstract": "ConnectionRefusedError"}
    assert listener.accepted == 0 and listener.received == b"" and abstract.accepted == 0


# ------------------------------------------------------------------ trainer sides
SECCOMP_DENY = r"""
import ctypes, platform, struct
_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
_NUMBERS = {"x86_64": {"unshare": 272, "keyctl": 250}, "aarch64": {"unshare": 97, "keyctl": 219}}
def _insn(code, k, jt=0, jf=0):
    return struct.pack("HBBI", code, jt, jf, k)
_prog = [_insn(0x20, 4), _insn(0x15, _ARCH, 1, 0), _insn(0x06, 0x7FFF0000), _insn(0x20, 0)]  # another arch: allow
for _name in DENIED:  # each: EPERM
    _prog += [_insn(0x15, _NUMBERS[platform.machine()][_name], 0, 1), _insn(0x06, 0x00050000 | 1)]
_prog = b"".join(_prog + [_insn(0x06, 0x7FFF0000)])
class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
_libc = ctypes.CDLL(None, use_errno=True)
_fprog = _Fprog(len(_prog) // 8, _prog)
assert _libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert _libc.prctl(22, 2, ctypes.byref(_fprog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER
"""
#: what a container runtime's default seccomp profile denies a process without CAP_SYS_ADMIN,
#: of what the sandbox uses (Docker's denies both with EPERM)
CONTAINER = ("unshare", "keyctl")


def trainer_side(script: str, *, denied: tuple[str, ...] = (), user: int | None = None, home: Path | None = None,
                 timeout: float = 120) -> dict:
    """Run ``script`` (Python, printing one JSON line last) as the trainer side: under a
    seccomp filter that denies the system calls ``denied`` with EPERM (``unshare``: a host
    that makes no namespaces); as ``user`` (via ``setpriv``) if given."""
    deny = f"DENIED = {denied!r}\n" + SECCOMP_DENY if denied else ""
    body = deny + textwrap.dedent(script)
    folder = Path(tempfile.mkdtemp(prefix="grpo-trainer-"))
    try:
        folder.chmod(0o755)
        driver = folder / "driver.py"
        driver.write_text(body)
        driver.chmod(0o644)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home or folder), "LANG": "C.UTF-8"}
        argv = [sys.executable, str(driver)]
        if user is not None:
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _reachable(), "sh", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=folder, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _reachable() -> str:
    """A shell script that makes this interpreter's folders reachable by any user in a private
    mount namespace (a 0700 folder above them, like /root, becomes a 0755 tmpfs holding only
    them), then runs its arguments."""
    lines = ["set -e"]
    keep = sorted({sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)), str(REPO)})
    closed = set()
    for path in keep:
        parts = Path(path).parts
        for i in range(2, len(parts) + 1):
            folder = Path(*parts[:i])
            if not folder.stat().st_mode & stat.S_IXOTH:
                closed.add(str(folder))
                break
    for folder in sorted(closed):
        inside = [p for p in keep if p.startswith(folder + "/")]
        for n, path in enumerate(inside):
            lines.append(f"mkdir -p /tmp/.grpo-keep-{os.getpid()}-{n} && mount --bind '{path}' "
                         f"/tmp/.grpo-keep-{os.getpid()}-{n}")
        lines.append(f"mount -t tmpfs -o mode=0755,size=1m tmpfs '{folder}'")
        for n, path in enumerate(inside):
            lines.append(f"mkdir -p '{path}' && mount --move /tmp/.grpo-keep-{os.getpid()}-{n} '{path}' && "
                         f"rmdir /tmp/.grpo-keep-{os.getpid()}-{n}")
    lines.append('exec "$@"')
    return "\n".join(lines)


# ------------------------------------------------------------------ item 3: an unprivileged trainer
@root_only
def test_under_an_unprivileged_trainer_the_code_cannot_read_its_secrets_or_reach_its_sockets(open_dir):
    home = open_dir / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / "agent").mkdir()
    token = home / ".cache" / "huggingface" / "token"
    token.write_text("hf_secret_token_of_the_trainer\n")
    listener = UnixListener(home / "agent" / "agent.sock")
    for path in [home, *home.rglob("*")]:
        os.chown(path, NOBODY, NOBODY)
        path.chmod(0o600 if not path.is_dir() else 0o700)
    code = textwrap.dedent(f"""
        import ctypes, json, os, socket
        status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())
        result = {{'uid': os.getuid(), 'caps': int(status['CapEff'], 16),
                   'userns': ctypes.CDLL(None).unshare(0x10000000)}}
        try:
            result['init'] = open('/proc/1/environ').read()
        except OSError as exc:
            result['init'] = type(exc).__name__
        try:
            result['token'] = open({str(token)!r}).read()
        except OSError as exc:
            result['token'] = type(exc).__name__
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect({str(home / 'agent' / 'agent.sock')!r})
            s.sendall(b'sign this')
            result['agent'] = 'connected'
        except OSError as exc:
            result['agent'] = type(exc).__name__
        print(json.dumps(result))
    """)
    script = f"""
        import json, os
        from grpo_plugins.rewards.sandbox import Limits, Sandbox
        assert os.getuid() == {NOBODY} and open({str(token)!r}).read()  # the trainer's own user reads it
        box = Sandbox(Limits(wall_s=10))
        outcome = box.run({{"a.py": {code!r}}}, ["{{python}}", "-I", "a.py"])
        print(json.dumps({{"code": outcome.output.decode(), "errors": outcome.errors.decode()[-2000:]}}))
    """
    try:
        answer = trainer_side(script, user=NOBODY, home=home)
    finally:
        listener.close()
    seen = json.loads(answer["code"] or "{}")
    assert seen == {"uid": NOBODY, "caps": 0, "userns": -1, "init": "PermissionError", "token": "FileNotFoundError",
                    "agent": "FileNotFoundError"}, answer
    assert listener.accepted == 0 and listener.received == b""


# ------------------------------------------------------------------ items 4 and 5: no namespaces
@seccomp_arch
def test_without_namespaces_the_refusal_names_sandbox_url_and_trusted_host():
    answer = trainer_side("""
        import json
        from grpo_plugins.rewards.sandbox import Limits, Sandbox, SandboxFailure
        try:
            Sandbox(Limits(wall_s=4))
            print(json.dumps({"refused": None}))
        except SandboxFailure as exc:
            print(json.dumps({"refused": str(exc)}))
    """, denied=CONTAINER)
    message = answer["refused"]
    assert message is not None and "Operation not permitted" in message
    assert "sandbox_url" in message and "trusted_host: true" in message
    assert "sandbox_fusion" not in message and "backend:" not in message


@seccomp_arch
def test_in_trusted_host_mode_a_setsid_grandchild_is_dead_after_the_deadline():
    code = textwrap.dedent("""
        import os, time
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(w, str(os.getpid()).encode())
                os.close(w)
                time.sleep(600)
            os._exit(0)
        os.close(w)
        print(os.read(r, 32).decode(), flush=True)
        time.sleep(600)
    """)
    answer = trainer_side(f"""
        import json, os, time
        from grpo_plugins.rewards.sandbox import Limits, Sandbox
        box = Sandbox(Limits(wall_s=2.0), trusted_host=True)
        started = time.monotonic()
        outcome = box.run({{"a.py": {code!r}}}, ["{{python}}", "-I", "a.py"])
        pid = int(outcome.output.decode().strip())
        try:
            state = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        print(json.dumps({{"isolated": box.isolate, "timed_out": outcome.timed_out, "state": state,
                           "pid": pid, "elapsed": time.monotonic() - started}}))
    """, denied=CONTAINER)
    assert answer["isolated"] is False and answer["timed_out"] is True
    assert answer["state"] in ("gone", "Z"), answer  # dead (at most not yet reaped by init)
    assert answer["elapsed"] < 15
    assert not _alive(answer["pid"])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ------------------------------------------------------------------ the trainer's keyring
@seccomp_arch
@pytest.mark.parametrize("namespaces", [True, False], ids=["isolated", "trusted_host"])
def test_the_keys_of_the_trainers_session_keyring_are_out_of_reach(namespaces):
    """A key in the trainer's session keyring is readable by whoever possesses the keyring,
    whatever their user id: the code gets an empty session keyring of its own."""
    add_key, keyctl = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
    code = textwrap.dedent(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        key = libc.syscall({keyctl}, 10, ctypes.c_int(-3), b"user", b"grpo-test-secret", 0)  # KEYCTL_SEARCH @s
        buffer = ctypes.create_string_buffer(64)
        size = libc.syscall({keyctl}, 11, key, buffer, 64) if key > 0 else -1  # KEYCTL_READ
        print(buffer.raw[:size].decode() if size > 0 else 'no key')
    """)
    answer = trainer_side(f"""
        import ctypes, json
        from grpo_plugins.rewards.sandbox import Limits, Sandbox
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall({keyctl}, 1, None) > 0  # a session keyring of this test's own
        assert libc.syscall({add_key}, b"user", b"grpo-test-secret", b"hf_in_the_keyring", 17, ctypes.c_int(-3)) > 0
        box = Sandbox(Limits(wall_s=10), trusted_host=True)
        outcome = box.run({{"a.py": {code!r}}}, ["{{python}}", "-I", "a.py"])
        print(json.dumps({{"isolated": box.isolate, "seen": outcome.output.decode().strip()}}))
    """, denied=() if namespaces else ("unshare",))
    assert answer == {"isolated": namespaces, "seen": "no key"}
