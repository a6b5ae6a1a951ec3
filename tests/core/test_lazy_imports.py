"""The engine and every built-in plugin import, and a spec loads, where the optional packages a
run may not need are not installed (as on a GPU machine that lacks them: ``bench/gpu/``): each
is imported only by the plugin that uses it, when it is used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

#: Installed for the test run, but needed only by the plugins that use them.
OPTIONAL = ("mlflow", "datasets", "math_verify", "trl", "vllm", "wandb", "tensorboard", "gguf", "peft", "ray")

PROGRAM = textwrap.dedent("""
    import sys
    for name in {optional!r}:
        sys.modules[name] = None  # importing it now raises ImportError, as where it is not installed
    try:
        import mlflow  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the block did not take effect")
    import grpo_core.checkpoint, grpo_core.cli, grpo_core.export  # noqa: E401
    import grpo_core.train.loop.assemble, grpo_core.train.loop.run  # noqa: E401
    from grpo_core.plugin_manager import DEFAULT_PLUGINS, load_plugins
    from grpo_core.spec import load_spec

    plugins = load_plugins(external=False)
    assert set(DEFAULT_PLUGINS) <= set(plugins.info), sorted(set(DEFAULT_PLUGINS) - set(plugins.info))
    spec = {{"model": {{"path": "some/model"}}, "rewards": [{{"name": "accuracy"}}], "tracking": [{{"name": "mlflow"}}],
            "data": {{"name": "arithmetic"}}}}
    loaded = load_spec(spec, plugins=plugins)
    assert loaded.spec.tracking[0].name == "mlflow"
    print("imported", len(plugins.info))
""")


def test_the_engine_and_its_plugins_import_without_the_optional_packages():
    program = PROGRAM.format(optional=OPTIONAL)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("imported")


def test_the_block_makes_a_module_that_needs_one_fail():
    """The negative control: the same block breaks an import that does need the package."""
    program = "import sys\nsys.modules['mlflow'] = None\nimport grpo_core.mlflow_model\n"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "import of mlflow halted" in done.stderr
