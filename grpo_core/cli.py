"""``grpo-run``: train from a spec (or dry-run it), validate it, write a starter spec, list
runs and plugins, print the JSON Schema.

Exit codes: 0 success, 1 runtime failure, 2 invalid spec or usage, 130 interrupted
(SIGINT), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from grpo_core.errors import GrpoError, UsageError

COMMANDS = ("run", "validate", "init", "runs", "plugins", "schema")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-run",
        description="Train a causal LM with GRPO from a YAML spec.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Commands: grpo-run SPEC (train; --dry-run: one rollout, no training), grpo-run validate SPEC,\n"
        "grpo-run init [--task math|tools|custom] [SPEC], grpo-run runs [FOLDER ...], grpo-run plugins,\n"
        "grpo-run schema.\nExit codes: 0 ok, 1 runtime failure, 2 invalid spec or usage, "
        "130 interrupted.",
    )
    sub = parser.add_subparsers(dest="command")

    def spec_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("spec", help="path to the YAML spec")
        p.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
            help="override a field, e.g. --set train.lr=1e-5 (value parsed as YAML); repeatable",
        )

    run = sub.add_parser("run", help="train (the default command)")
    spec_args(run)
    run.add_argument(
        "--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
        help="continue the run from its latest checkpoint, or from the given checkpoint folder",
    )
    run.add_argument(
        "--nproc", type=int, default=1, metavar="N",
        help="train in N data-parallel processes on this machine (one per GPU, or N on the CPU); "
        "for several machines use accelerate launch or torchrun with -m grpo_core.cli run SPEC",
    )
    run.add_argument(
        "--dry-run", action="store_true",
        help="validate, build the model and data, sample and score one step's completions and print "
        "them with their rewards; no training, no checkpoint, no tracker run",
    )
    validate = sub.add_parser("validate", help="validate a spec and print it with every default filled in")
    spec_args(validate)
    init = sub.add_parser("init", help="write a commented starter spec (and the files it names)")
    init.add_argument("spec", nargs="?", default="spec.yaml", help="where to write it (default: spec.yaml)")
    init.add_argument("--task", choices=("math", "tools", "custom"), default="math",
                      help="math: GSM8K on Qwen2.5; tools: tool calls rewarded by a local plugin; "
                      "custom: your data and reward function (default: math)")
    init.add_argument("--force", action="store_true", help="overwrite existing files")
    runs = sub.add_parser("runs", help="list run folders: last step, status, held-out score")
    runs.add_argument("folders", nargs="*", default=["runs"],
                      help="run folders, or folders holding them (default: runs)")
    plugins = sub.add_parser("plugins", help="list plugins and the components they register")
    plugins.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser("schema", help="print the JSON Schema of a spec, with every installed plugin's options")
    return parser


def _normalize(argv: list[str]) -> list[str]:
    """``grpo-run SPEC ...`` means ``grpo-run run SPEC ...``."""
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):
        return ["run", *argv]
    return argv


def _cmd_validate(args) -> int:
    from grpo_core.spec import dump_spec, load_spec

    loaded = load_spec(args.spec, args.overrides)
    sys.stdout.write(dump_spec(loaded.spec))
    return 0


def _cmd_init(args) -> int:
    from pathlib import Path

    from grpo_core.starter import write_starter

    written = write_starter(args.task, Path(args.spec), force=args.force)
    print("wrote " + ", ".join(map(str, written)))
    print(f"next: grpo-run validate {args.spec}   then: grpo-run {args.spec} --dry-run")
    return 0


def _cmd_runs(args) -> int:
    from pathlib import Path

    from grpo_core.runs import find_runs, print_runs

    infos = find_runs([Path(f) for f in args.folders])
    if not infos:
        print(f"no run folders in {', '.join(args.folders)}", file=sys.stderr)
        return 0
    print_runs(infos)
    return 0


def _cmd_plugins(args) -> int:
    from grpo_core.hookspecs import KINDS
    from grpo_core.plugin_manager import load_plugins

    plugins = load_plugins()
    if args.json:
        payload = [
            {"name": i.name, "source": i.source, "distribution": i.distribution,
             "version": i.version, "location": i.location, "components": i.components}
            for i in plugins.info.values()
        ]
        print(json.dumps(payload, indent=2))
        return 0
    for key, info in plugins.info.items():
        dist = f"{info.distribution} {info.version or ''}".strip() if info.distribution else info.location
        print(f"{info.name}  ({info.source}: {dist})")
        for kind, names in info.components.items():
            print(f"  {KINDS[kind].label}: {', '.join(names)}")
        hooks = [h.name for h in plugins.manager.get_hookcallers(plugins.manager.get_plugin(key)) or []]
        if not info.components and hooks:
            print(f"  hooks: {', '.join(hooks)} (registered nothing)")
    return 0


def _cmd_schema(args) -> int:
    from grpo_core.plugin_manager import load_plugins
    from grpo_core.spec.schema import spec_schema

    print(json.dumps(spec_schema(load_plugins().registry), indent=2))
    return 0


def _cmd_run(args) -> int:
    from grpo_core.spec import load_spec
    from grpo_core.train.distributed import world_size_from_env
    from grpo_core.train.run import train

    loaded = load_spec(args.spec, args.overrides)
    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    if args.dry_run:
        if args.nproc > 1 or args.resume is not None:
            raise UsageError("--dry-run runs one process from scratch: drop --nproc and --resume")
        from grpo_core.dryrun import dry_run

        return dry_run(loaded)
    if args.nproc > 1 and world_size_from_env() == 1:
        return _launch(args, loaded)
    return train(loaded, resume=args.resume)


def _launch(args, loaded) -> int:
    """Start ``args.nproc`` copies of this command, one per rank, with the environment
    torchrun would give them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...), and wait.
    SIGINT and SIGTERM are passed on, so every process checkpoints and stops at the same
    step; if one process fails, the others are stopped. Returns the first non-zero exit
    code (the main process's when it has one), else 0."""
    import signal
    import socket
    import subprocess
    import time

    from grpo_core.train.distributed import check_layout

    check_layout(loaded.spec, args.nproc)
    with socket.socket() as sock:  # a free port for the process group's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "grpo_core.cli", "run", args.spec]
    for override in args.overrides:
        command += ["--set", override]
    if args.resume is not None:
        command += ["--resume", args.resume]
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // args.nproc))
    procs = []
    for rank in range(args.nproc):
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc),
            "LOCAL_WORLD_SIZE": str(args.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": threads,
        }
        # Own session: a terminal's Ctrl-C reaches the children once, forwarded by this
        # process, not twice (a second signal means "stop now, no checkpoint").
        procs.append(subprocess.Popen(command, env=env, start_new_session=True))

    def forward(signum, frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(proc.poll() is None for proc in procs):
            if any(proc.returncode not in (None, 0) for proc in procs):  # one failed: stop the rest
                time.sleep(5)  # give the others a moment to fail with their own message
                for proc in procs:
                    if proc.poll() is None:
                        proc.terminate()
            time.sleep(0.1)
        codes = [proc.wait() for proc in procs]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return next((c for c in codes if c), 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        args = parser.parse_args(_normalize(argv))
    except SystemExit as exc:  # argparse already printed the usage message
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"run": _cmd_run, "validate": _cmd_validate, "init": _cmd_init, "runs": _cmd_runs,
               "plugins": _cmd_plugins, "schema": _cmd_schema}
    try:
        return handler[args.command](args)
    except GrpoError as exc:
        print(f"grpo-run: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("grpo-run: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug or an unexpected failure: one line, details on demand
        if os.environ.get("GRPO_DEBUG"):
            traceback.print_exc()
        else:
            print(
                f"grpo-run: error: {type(exc).__name__}: {exc}\n"
                "(set GRPO_DEBUG=1 to see the traceback)",
                file=sys.stderr,
            )
        return 1


def _entry() -> None:  # pragma: no cover
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    _entry()
