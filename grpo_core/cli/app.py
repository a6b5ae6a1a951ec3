"""``grpo-run``: train from a spec (or dry-run it), evaluate a model, validate a spec, write a
starter spec, list runs and plugins, print the JSON Schema; and the commands plugins add
(:mod:`grpo_core.commands`, e.g. ``grpo-run serve`` of the vLLM plugins).

Exit codes: 0 success, 1 runtime failure, 2 invalid spec or usage (or a fresh run in a
folder holding another run, or any run in a folder a live run holds), 130 interrupted
(SIGINT), 143 terminated (SIGTERM); under ``--nproc``, 128 + N when a process was killed
by signal N.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from collections.abc import Mapping

from grpo_core.commands import BUILTIN_COMMANDS, Command, split_passthrough
from grpo_core.errors import GrpoError, UsageError, fault_text, plugin_origin


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="path to the YAML spec")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
        help="override a field, e.g. --set train.lr=1e-5 (value parsed as YAML); repeatable",
    )


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="train (the default command)")
    _spec_args(run)
    run.add_argument(
        "--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
        help="continue the run from its latest checkpoint, or from the given checkpoint folder",
    )
    run.add_argument(
        "--overwrite", action="store_true",
        help="start afresh in a run folder that holds another run: its checkpoints, metrics.jsonl and "
        "final model are moved to <run folder>/overwritten/<time>/ (without it such a folder is refused)",
    )
    run.add_argument(
        "--nproc", type=int, default=1, metavar="N",
        help="train in N data-parallel processes on this machine (one per GPU, or N on the CPU); "
        "for several machines use accelerate launch or torchrun with -m grpo_core.cli run SPEC, or a launcher",
    )
    run.add_argument(
        "--launcher", default=None, metavar="NAME",
        help="the launcher that starts the run's processes (grpo-run plugins lists them); default: local "
        "when --nproc is above 1, none (this process trains) otherwise",
    )
    run.add_argument(
        "--launcher-option", dest="launcher_options", action="append", default=[], metavar="KEY=VALUE",
        help="an option of the launcher (value parsed as YAML); repeatable",
    )
    run.add_argument(
        "--dry-run", action="store_true",
        help="validate, build the model and data, sample and score one step's completions and print "
        "them with their rewards; no training, no checkpoint, no tracker run",
    )


def _add_others(sub) -> None:
    evaluate = sub.add_parser(
        "eval", help="evaluate a saved model (or the spec's base model) on the spec's held-out sets, "
        "without training; prints a table"
    )
    _spec_args(evaluate)
    evaluate.add_argument(
        "--model", default=None, metavar="FOLDER",
        help="a model saved by grpo-run (runs/<name>/final, or a checkpoint folder); default: the spec's model",
    )
    evaluate.add_argument("--json", action="store_true", help="print the metrics as JSON instead of a table")
    validate = sub.add_parser("validate", help="validate a spec and print it with every default filled in")
    _spec_args(validate)
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


def _add_plugin_commands(sub, commands: Mapping[str, Command]) -> None:
    for command in commands.values():
        command.configure(sub.add_parser(command.name, help=command.help, description=command.description))


def _parser(commands: Mapping[str, Command] | None = None) -> argparse.ArgumentParser:
    """grpo-run's own commands, then ``commands`` (those plugins register)."""
    commands = commands or {}
    added = ", ".join(f"grpo-run {name} ({command.plugin})" for name, command in commands.items())
    parser = argparse.ArgumentParser(
        prog="grpo-run",
        description="Train a causal LM with GRPO from a YAML spec.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit codes: 0 ok, 1 runtime failure, 2 invalid spec or usage, 130 interrupted, 143 terminated.\n"
        "Commands: grpo-run SPEC (train; --dry-run: one rollout, no training), grpo-run eval SPEC,\n"
        "grpo-run validate SPEC, grpo-run init [--task math|tools|custom] [SPEC], grpo-run runs [FOLDER ...],\n"
        "grpo-run plugins, grpo-run schema." + (f"\nCommands of plugins: {added}." if added else ""),
    )
    sub = parser.add_subparsers(dest="command")
    _add_run(sub)
    _add_others(sub)
    _add_plugin_commands(sub, commands)
    return parser


def _plugin_commands(argv: list[str]) -> dict[str, Command]:
    """The commands plugins register, when the command line may name one (its first word is
    not one of grpo-run's own commands: a plugin command, a spec, ``--help``, nothing);
    else none, and no plugin is loaded for the parser."""
    if argv and argv[0] in BUILTIN_COMMANDS:
        return {}
    from grpo_core.plugin_manager import load_plugins

    return load_plugins().commands


def _normalize(argv: list[str], commands: Mapping[str, Command]) -> list[str]:
    """``grpo-run SPEC ...`` means ``grpo-run run SPEC ...``."""
    if argv and argv[0] not in BUILTIN_COMMANDS and argv[0] not in commands and not argv[0].startswith("-"):
        return ["run", *argv]
    return argv


def _cmd_validate(args) -> int:
    from grpo_core.spec import dump_spec, load_spec

    loaded = load_spec(args.spec, args.overrides)
    sys.stdout.write(dump_spec(loaded.spec))
    return 0


def _cmd_init(args) -> int:
    from pathlib import Path

    from grpo_core.cli.init import write_starter

    written = write_starter(args.task, Path(args.spec), force=args.force)
    print("wrote " + ", ".join(map(str, written)))
    print(f"next: grpo-run validate {args.spec}   then: grpo-run {args.spec} --dry-run")
    return 0


def _cmd_runs(args) -> int:
    from pathlib import Path

    from grpo_core.cli.runs import find_runs, print_runs

    infos = find_runs([Path(f) for f in args.folders])
    if not infos:
        print(f"no run folders in {', '.join(args.folders)}", file=sys.stderr)
        return 0
    print_runs(infos)
    return 0


def _cmd_plugins(args) -> int:
    from grpo_core.kinds import KINDS
    from grpo_core.plugin_manager import load_plugins

    plugins = load_plugins()
    if args.json:
        payload = [
            {"name": i.name, "source": i.source, "distribution": i.distribution,
             "version": i.version, "location": i.location, "components": i.components,
             "commands": i.commands}
            for i in plugins.info.values()
        ]
        print(json.dumps(payload, indent=2))
        return 0
    for key, info in plugins.info.items():
        dist = f"{info.distribution} {info.version or ''}".strip() if info.distribution else info.location
        print(f"{info.name}  ({info.source}: {dist})")
        for kind, names in info.components.items():
            print(f"  {KINDS[kind].label}: {', '.join(names)}")
        if info.commands:
            print(f"  commands: {', '.join(f'grpo-run {name}' for name in info.commands)}")
        hooks = [h.name for h in plugins.manager.get_hookcallers(plugins.manager.get_plugin(key)) or []]
        if not info.components and not info.commands and hooks:
            print(f"  hooks: {', '.join(hooks)} (registered nothing)")
    return 0


def _cmd_schema(args) -> int:
    from grpo_core.plugin_manager import load_plugins
    from grpo_core.spec.schema import spec_schema

    print(json.dumps(spec_schema(load_plugins().registry), indent=2))
    return 0


def _cmd_eval(args) -> int:
    from grpo_core.cli.eval import evaluate_model, format_table, saved_model_folder
    from grpo_core.spec import load_spec

    loaded = load_spec(args.spec, args.overrides)
    if args.model is not None:
        saved_model_folder(args.model)  # a bad path is a usage error before anything loads
    metrics = evaluate_model(loaded, args.model)
    print(f"grpo-run eval: {args.model or 'the spec model'} on {loaded.name}", file=sys.stderr)
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        print(format_table(metrics, list(loaded.spec.eval.sets)))
    return 0


def _launcher_options(assignments: list[str]) -> dict:
    import yaml

    options = {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--launcher-option expects KEY=VALUE, got {assignment!r}")
        options[key.strip()] = yaml.safe_load(value) if value else None
    return options


def _cmd_run(args) -> int:
    from grpo_core.checkpoint import claim_run_folder, run_folder
    from grpo_core.contracts import RunArguments
    from grpo_core.launching import PARENT_ENV, build_launcher, die_with_launcher, launch
    from grpo_core.runlock import hold_run_folder
    from grpo_core.spec import load_spec
    from grpo_core.train.distributed import world_size_from_env
    from grpo_core.train.loop.run import train

    die_with_launcher()
    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    options = _launcher_options(args.launcher_options)
    if options and args.launcher is None and args.nproc == 1:
        raise UsageError("--launcher-option needs --launcher NAME (or --nproc above 1, for the local launcher)")
    if args.dry_run and (args.nproc > 1 or args.resume is not None or args.launcher is not None):
        raise UsageError("--dry-run runs one process from scratch: drop --nproc, --launcher and --resume")
    # This process launches the run (not a process a launcher started): its launcher is built
    # before the spec is validated, since the rollout servers it places change what the spec names.
    launching = (args.launcher is not None or args.nproc > 1) and world_size_from_env() == 1
    name = args.launcher or "local"
    loaded = load_spec(args.spec, args.overrides,
                       launcher=(lambda registry: build_launcher(registry, name, options)) if launching else None)
    if args.dry_run:
        from grpo_core.cli.dryrun import dry_run

        return dry_run(loaded)
    main_process = os.environ.get("RANK", "0") in ("", "0")
    # The launching process holds the folder's lock (a launcher's children do not).
    locking = main_process and not os.environ.get(PARENT_ENV)
    folder = run_folder(loaded)
    with hold_run_folder(folder) if locking else contextlib.nullcontext():
        if args.resume is None:  # every process checks; only the main one moves files aside
            claim_run_folder(folder, args.overwrite, move=main_process)
        if launching:
            run = RunArguments(spec=args.spec, overrides=tuple(args.overrides), resume=args.resume,
                               nproc=args.nproc, run_folder=str(folder))
            return launch(run, loaded.spec, loaded.launcher)
        return train(loaded, resume=args.resume)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        commands = _plugin_commands(argv)
    except GrpoError as exc:  # a plugin that fails to load: no parser without it
        print(f"grpo-run: error: {exc}", file=sys.stderr)
        return exc.exit_code
    parser = _parser(commands)
    command = commands.get(argv[0]) if argv else None
    passthrough: list[str] = []
    if command is not None and command.passthrough:  # what follows -- is the command's, unparsed
        argv, passthrough = split_passthrough(argv)
    try:
        args = parser.parse_args(_normalize(argv, commands))
    except SystemExit as exc:  # argparse already printed the usage message
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    if command is not None and command.passthrough:
        args.passthrough = passthrough
    handler = {
        "run": _cmd_run, "eval": _cmd_eval, "validate": _cmd_validate, "init": _cmd_init, "runs": _cmd_runs,
        "plugins": _cmd_plugins, "schema": _cmd_schema,
    }
    try:
        return handler[args.command](args) if command is None else command.run(args)
    except GrpoError as exc:
        print(f"grpo-run: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # a second SIGINT/SIGTERM during a run (Interrupted), or Ctrl-C elsewhere
        print("grpo-run: interrupted", file=sys.stderr)
        return getattr(exc, "exit_code", 130)
    except SystemExit as exc:  # sys.exit() in plugin code (a loss, a tracker...): its fault, not an exit code
        print(f"grpo-run: error: {fault_text(exc)} in plugin code{plugin_origin(exc)}", file=sys.stderr)
        return 1
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
    from grpo_core.train.signals import end_process_on_signal, stop_signal_received, threads_left_running

    end_process_on_signal()
    code = main()
    # A run stopped by a signal leaves without interpreter finalization too: a second signal
    # during it would kill the process by the signal's default action (-N, no message)
    # instead of ending it with 128 + N (issue 47).
    if (os.environ.get("WORLD_SIZE", "1") not in ("", "1") or threads_left_running()
            or stop_signal_received() is not None):
        exit_process(code)
    sys.exit(code)


def exit_process(code: int) -> None:
    """End a process of a multi-process run, one whose run left a thread running (an
    asynchronous actor in the middle of a batch after a failure or a second signal), or one
    whose run a signal stopped, its work done, without interpreter finalization.

    ``DistributedDataParallel``'s reducer keeps the gloo process group alive after
    ``destroy_process_group`` (its communication threads are still running when ``main``
    returns, seen in ``/proc/self/task``), and a gloo thread that touches a Python object
    while the interpreter shuts down aborts the process (``terminate called without an active
    exception``, exit 134) after a run that finished. Everything a run keeps (checkpoints,
    model, metrics, the tracker's run) is written and closed before ``main`` returns; the
    exit handlers still run (libraries' clean-ups, such as vLLM's shared-memory segments),
    then the process flushes its output and leaves, as launchers' workers commonly do."""
    import atexit
    import logging

    atexit._run_exitfuncs()  # the interpreter is whole here: the abort happens after them
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    _entry()
