"""``quickstart --import MODULE``: a plugin's interface selected with one option; whatever
the launched processes could not import is refused at once, before anything is launched."""

import os
import subprocess
import sys
import textwrap

import pytest

from realhf.apps import main as app_main
from realhf.apps import plugins, quickstart
from realhf.experiments.registry import register_quickstart_exp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PLUGIN = textwrap.dedent(
    """
    from realhf.api.core.model_api import ModelInterface
    from realhf.api.core.registry import register_interface


    class Algo(ModelInterface):
        def __init__(self, decay: float = 0.5):
            self.decay = decay

        def train_step(self, model, data, mb_spec):
            model.inc_version()
            return {}


    register_interface("{name}", Algo)
    """
)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """``plugin(module, interface)``: a module under tmp_path registering ``interface``."""
    root = tmp_path / "plugins"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.delenv(plugins.ENV_VAR, raising=False)

    def make(module: str, interface: str) -> str:
        (root / f"{module}.py").write_text(PLUGIN.replace("{name}", interface))
        return module

    return make


def _qs(capsys, *argv):
    code = quickstart.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_import_then_one_option_selects_the_train_interface(plugin, capsys):
    mod = plugin("plug_qs_algo", "plug_qs_algo")
    code, out, err = _qs(
        capsys,
        "ppo-math",
        "--import",
        mod,
        "actor.train_interface=plug_qs_algo",
        "actor.train_interface_args.decay=0.9",
        "--dry-run",
    )
    assert code == 0, err
    table = {line.split()[0]: line for line in out.splitlines() if "  d1p1m1  " in line}
    assert "plug_qs_algo(decay=0.9)" in table["actor_train"]
    assert "ppo_actor" in table["actor_gen"]  # generation stays with the built-in actor


def test_env_var_route(plugin, capsys, monkeypatch):
    mod = plugin("plug_qs_env", "plug_qs_env")
    monkeypatch.setenv(plugins.ENV_VAR, mod)
    code, out, err = _qs(capsys, "ppo-math", "actor.train_interface=plug_qs_env", "--dry-run")
    assert code == 0, err
    assert "plug_qs_env()" in out


def test_unknown_interface_suggests_the_closest_and_the_import(plugin, capsys):
    mod = plugin("plug_qs_typo", "plug_qs_typo_algo")
    code, _, err = _qs(
        capsys, "ppo-math", f"--import={mod}", "actor.train_interface=plug_qs_typo_alg"
    )
    assert code == 2
    assert "actor.train_interface='plug_qs_typo_alg'" in err
    assert "did you mean 'plug_qs_typo_algo'?" in err
    code, _, err = _qs(capsys, "ppo-math", "actor.train_interface=nothing_like_it")
    assert code == 2 and "--import MODULE" in err


def test_an_unimportable_module_fails_at_once_with_the_pythonpath_hint(tmp_path, capsys):
    code, out, err = _qs(
        capsys, "ppo-math", "--import", "no_such_plugin_xyz.algo", f"fileroot={tmp_path}"
    )
    assert code == 2
    assert "No module named 'no_such_plugin_xyz'" in err and "PYTHONPATH" in err
    assert os.listdir(tmp_path) == []  # nothing launched, nothing written
    code, _, err = _qs(capsys, "ppo-math", "--import")
    assert code == 2 and "--import needs a module name" in err


def test_help_documents_import_and_the_interface_options(capsys):
    code, out, _ = _qs(capsys, "ppo-math", "--help")
    assert code == 0
    assert "--import MODULE" in out and plugins.ENV_VAR in out
    assert "actor.train_interface (str, default: 'ppo_actor')" in out
    assert "actor.train_interface_args" in out
    assert "ppo.* options configure the built-in ppo_actor" in out
    assert (
        "registered interfaces: " in out and "ppo_actor" in out.split("registered interfaces: ")[1]
    )


def test_the_imports_reach_the_controller_and_every_worker(plugin, monkeypatch, tmp_path):
    mod = plugin("plug_qs_launch", "plug_qs_launch")
    seen = {}

    def fake_launch(experiment_cfg, *args, **kwargs):
        seen.update(kwargs, types=sorted(experiment_cfg.workers))

    monkeypatch.setattr(app_main, "launcher", lambda mode: fake_launch)
    code = quickstart.main(
        [
            "ppo-math",
            "--import",
            mod,
            "actor.train_interface=plug_qs_launch",
            f"fileroot={tmp_path}",
            "eval=false",
        ]
    )
    assert code == 0
    # One list for the controller and every worker type (realhf.apps.remote --import).
    assert seen["imports"] == ["realhf.experiments.ppo_math", mod]
    assert seen["types"] == ["master_worker", "model_worker"]


def test_an_experiment_defined_in_the_running_script_is_refused(tmp_path, capsys):
    class ScriptConfig:
        pass

    def build(cfg):
        raise AssertionError("must not be built")

    ScriptConfig.__module__ = build.__module__ = "__main__"
    register_quickstart_exp("plug-script-exp", ScriptConfig, build)
    assert app_main.run("plug-script-exp", ScriptConfig()) == 2
    err = capsys.readouterr().err
    assert "defined in the script being run (__main__)" in err
    assert "Can't get attribute 'test_an_experiment" in err and "--import my_exp" in err


@pytest.mark.slow
def test_an_interface_defined_in_the_running_script_is_refused(tmp_path):
    script = tmp_path / "my_run.py"
    script.write_text(
        PLUGIN.replace("{name}", "in_script_algo")
        + textwrap.dedent(
            f"""
            import sys
            from realhf.apps import quickstart

            sys.exit(quickstart.main(["ppo-math", "actor.train_interface=in_script_algo",
                                      "fileroot={tmp_path / "runs"}"]))
            """
        )
    )
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is defined in the script being run (__main__)" in r.stderr
    assert "--import my_algo" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_hydra_entry_points_take_plugins_from_the_environment(plugin, monkeypatch):
    from omegaconf import OmegaConf

    from realhf.apps.hydra_entry import run_from_hydra
    from realhf.experiments.ppo_math import PPOMathConfig

    mod = plugin("plug_qs_hydra", "plug_qs_hydra")
    monkeypatch.setenv(plugins.ENV_VAR, mod)
    seen = {}
    monkeypatch.setattr(
        app_main, "run", lambda name, cfg, imports: seen.update(cfg=cfg, imports=imports) or 0
    )
    hydra_cfg = OmegaConf.create({"actor": {"train_interface": "plug_qs_hydra"}})
    assert run_from_hydra("ppo-math", PPOMathConfig, hydra_cfg) == 0
    assert seen["imports"][0] == mod and seen["cfg"].actor.train_interface == "plug_qs_hydra"
