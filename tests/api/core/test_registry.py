"""Registries: register/make, helpful errors for unknown names, duplicates and bad args."""

import pytest

from realhf.api.core import registry as config
from realhf.api.core.registry import (
    AgentAbstraction,
    DatasetAbstraction,
    EnvAbstraction,
    InterfaceAbstraction,
    Registry,
    RegistryError,
)


class Scaled:
    def __init__(self, tokenizer, scale: float = 1.0):
        self.tokenizer, self.scale = tokenizer, scale


class Other:
    def __init__(self, scale: float = 1.0):
        self.scale = scale


@pytest.fixture
def reg():
    r = Registry("dataset", DatasetAbstraction)
    r.register("math_prompt", Scaled)
    r.register("code_prompt", Other)
    return r


def test_make_merges_system_args_and_user_args(reg):
    obj = reg.make(DatasetAbstraction("math_prompt", {"scale": 2.0}), tokenizer="tok")
    assert isinstance(obj, Scaled) and obj.tokenizer == "tok" and obj.scale == 2.0
    assert reg.make("code_prompt").scale == 1.0
    assert reg.names() == ["code_prompt", "math_prompt"] and "math_prompt" in reg


def test_unknown_name_lists_registered_and_closest(reg):
    with pytest.raises(RegistryError) as e:
        reg.make(DatasetAbstraction("math_promt"))
    msg = str(e.value)
    assert "unknown dataset 'math_promt'" in msg and "did you mean 'math_prompt'?" in msg
    assert "['code_prompt', 'math_prompt']" in msg
    with pytest.raises(RegistryError, match="unknown dataset 'zzzzzz'; registered"):
        reg.get("zzzzzz")


def test_duplicate_registration_is_an_error_but_reregistering_is_not(reg):
    reg.register("math_prompt", Scaled)  # same class again (module re-import): fine
    with pytest.raises(
        RegistryError, match="already registered to .*Scaled; cannot register .*Other"
    ):
        reg.register("math_prompt", Other)
    with pytest.raises(RegistryError, match="not callable"):
        reg.register("x", 3)


def test_rejected_args_name_the_class_and_accepted_ones(reg):
    with pytest.raises(
        RegistryError, match=r"'code_prompt' \(.*Other\) rejects .*\['scael'\].*accepts \['scale'\]"
    ):
        reg.make(DatasetAbstraction("code_prompt", {"scael": 3}))
    with pytest.raises(RegistryError, match=r"arguments \['tokenizer'\] are set by the system"):
        reg.make(DatasetAbstraction("math_prompt", {"tokenizer": "x"}), tokenizer="tok")
    with pytest.raises(RegistryError, match="expects a DatasetAbstraction or a name"):
        reg.make(3)


def test_abstractions_validate():
    assert InterfaceAbstraction("ppo").args == {}
    assert AgentAbstraction("a", None).args == {}
    with pytest.raises(ValueError, match="type_ must be a non-empty registered name"):
        EnvAbstraction("")
    with pytest.raises(ValueError, match="args must be a dict"):
        InterfaceAbstraction("ppo", args=[1])


@pytest.mark.parametrize(
    "register, make, abstraction",
    [
        (config.register_dataset, config.make_dataset, config.DatasetAbstraction),
        (config.register_interface, config.make_interface, config.InterfaceAbstraction),
        (config.register_backend, config.make_backend, config.BackendAbstraction),
        (config.register_model, config.make_model, config.ModelAbstraction),
        (config.register_agent, config.make_agent, config.AgentAbstraction),
        (config.register_env, config.make_env, config.EnvAbstraction),
    ],
)
def test_global_registries_round_trip(register, make, abstraction):
    register("tests.api.core.other", Other)
    assert make(abstraction("tests.api.core.other", {"scale": 3})).scale == 3
    with pytest.raises(RegistryError, match="did you mean 'tests.api.core.other'"):
        make("tests.api.core.othr")


def test_check_runs_the_checks_of_make_without_building(reg):
    built = []
    reg.register("counted", lambda scale=1.0: built.append(scale))
    assert reg.check(DatasetAbstraction("counted", {"scale": 2.0})) is not None
    assert built == []
    with pytest.raises(RegistryError, match="did you mean 'math_prompt'"):
        reg.check("math_promt")
    with pytest.raises(RegistryError, match="rejects the arguments"):
        reg.check(DatasetAbstraction("code_prompt", {"nope": 1}))
