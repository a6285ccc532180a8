"""Plugins: --import modules, $REALHF_PLUGINS and the realhf.plugins entry points; what a
launched process could not import fails in the launcher, saying how to fix it."""

import os
import sys
import types

import pytest

from realhf.apps import plugins


def _module(root, name: str, body: str = "LOADED = True\n") -> str:
    """Write module ``name`` (dotted: packages made as needed) under ``root``."""
    parts = name.split(".")
    d = root
    for p in parts[:-1]:
        d = d / p
        d.mkdir(exist_ok=True)
        (d / "__init__.py").touch()
    path = d / f"{parts[-1]}.py"
    path.write_text(body)
    return str(path)


@pytest.fixture
def plugin_root(tmp_path, monkeypatch):
    """A directory on sys.path (and PYTHONPATH: nothing to share) for throwaway modules."""
    root = tmp_path / "plugins"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.delenv(plugins.ENV_VAR, raising=False)
    return root


def test_load_imports_the_modules_and_returns_their_names(plugin_root):
    _module(plugin_root, "plug_ok_a")
    _module(plugin_root, "plug_pkg_b.algo")
    assert plugins.load(["plug_ok_a", "plug_pkg_b.algo", "plug_ok_a"]) == [
        "plug_ok_a",
        "plug_pkg_b.algo",
    ]
    assert sys.modules["plug_pkg_b.algo"].LOADED


def test_env_var_and_entry_points_follow_the_command_line(plugin_root, monkeypatch):
    for m in ("plug_env_a", "plug_env_b", "plug_ep_c"):
        _module(plugin_root, m)
    # An installed package's entry point, as pip would leave it on the path.
    dist = plugin_root / "plug_dist-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plug-dist\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{plugins.ENTRY_POINT_GROUP}]\nmy_algo = plug_ep_c\n")
    monkeypatch.setenv(plugins.ENV_VAR, "plug_env_a, plug_env_b")
    assert plugins.from_env() == ["plug_env_a", "plug_env_b"]
    assert "plug_ep_c" in plugins.from_entry_points()
    loaded = plugins.load(["plug_env_b"])
    assert loaded[:3] == ["plug_env_b", "plug_env_a", "plug_ep_c"]
    assert all(m in sys.modules for m in loaded)


def test_a_module_not_on_the_path_gets_the_pythonpath_hint(plugin_root):
    with pytest.raises(plugins.PluginError) as e:
        plugins.import_plugin("no_such_pkg_xyz.algo")
    msg = str(e.value)
    assert "No module named 'no_such_pkg_xyz'" in msg
    assert "PYTHONPATH" in msg and os.getcwd() in msg
    with pytest.raises(plugins.PluginError, match="not a file path: try --import my_dir.algo"):
        plugins.import_plugin("my_dir/algo.py")


def test_the_running_script_is_refused(plugin_root, monkeypatch):
    path = _module(plugin_root, "plug_script", "raise AssertionError('must not be imported')\n")
    with pytest.raises(plugins.PluginError, match=r"script being run \(__main__\)"):
        plugins.import_plugin("__main__")
    fake_main = types.ModuleType("__main__")
    fake_main.__file__ = path
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    with pytest.raises(plugins.PluginError) as e:
        plugins.import_plugin("plug_script")
    assert "script being run (__main__)" in str(e.value) and "--import my_algo" in str(e.value)


def test_a_module_that_fails_on_import_shows_its_traceback(plugin_root):
    _module(plugin_root, "plug_broken", "x = 1\nraise RuntimeError('boom in plugin')\n")
    with pytest.raises(plugins.PluginError) as e:
        plugins.import_plugin("plug_broken")
    assert "failed while importing" in str(e.value) and "boom in plugin" in str(e.value)


def test_a_directory_only_this_process_sees_is_shared_through_pythonpath(tmp_path, monkeypatch):
    # As when a launching script's own directory holds the plugin: launched processes
    # start elsewhere and find it only through PYTHONPATH.
    root = tmp_path / "script_dir"
    root.mkdir()
    _module(root, "plug_shared_pkg.algo")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.chdir(tmp_path)
    plugins.import_plugin("plug_shared_pkg.algo")
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == os.path.realpath(root)
