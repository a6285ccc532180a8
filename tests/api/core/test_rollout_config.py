"""Configs of the rollout-side workers validate themselves and name the field, value and fix."""

import math

import pytest

from realhf.api.core.registry import AgentAbstraction, DatasetAbstraction, EnvAbstraction
from realhf.api.core.rollout_config import (
    GenerationBackend,
    GenerationServerConfig,
    GserverManagerConfig,
    RolloutWorkerConfig,
    SchedulePolicy,
)


def test_config_names_are_validated_into_enums():
    cfg = GserverManagerConfig(schedule_policy="least_requests")  # as the CLI gives it
    assert cfg.schedule_policy is SchedulePolicy.LEAST_REQUESTS
    assert GserverManagerConfig().schedule_policy is SchedulePolicy.ROUND_ROBIN
    assert GenerationServerConfig(model_path="/m", backend="sglang").backend is (
        GenerationBackend.SGLANG
    )
    with pytest.raises(ValueError, match=r"schedule_policy='fastest' is invalid: use one of \("):
        GserverManagerConfig(schedule_policy="fastest")


@pytest.mark.parametrize(
    "make, needle",
    [
        (
            lambda: GserverManagerConfig(n_servers=0),
            r"GserverManagerConfig.n_servers=0 is invalid: use an integer >= 1$",
        ),
        (
            lambda: GserverManagerConfig(keep_weight_versions=0),
            r"keep_weight_versions=0 is invalid: use an integer >= 1 or None$",
        ),
        (
            lambda: GenerationServerConfig(model_path="/m", health_timeout_s=math.inf),
            r"health_timeout_s=inf is invalid: use a positive, finite number of seconds$",
        ),
        (
            lambda: RolloutWorkerConfig(
                AgentAbstraction("a"),
                EnvAbstraction("e"),
                DatasetAbstraction("d"),
                "/tok",
                seeded_sampling=1,
            ),
            r"RolloutWorkerConfig.seeded_sampling=1 is invalid: use true or false$",
        ),
    ],
)
def test_bad_fields_are_named_with_the_fix(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


def test_a_device_the_vllm_backend_would_not_use_is_refused_before_launch():
    # vLLM places itself; the server used to start wherever vLLM chose, silently.
    with pytest.raises(ValueError, match=r"device='cuda:1' is invalid: backend=vllm places"):
        GenerationServerConfig(model_path="/m", backend="vllm", device="cuda:1")
    assert GenerationServerConfig(model_path="/m", backend="vllm").device == "auto"
    assert GenerationServerConfig(model_path="/m", device="cuda:1").device == "cuda:1"


def test_api_key_stays_out_of_reprs_and_bad_auth_options_are_refused():
    cfg = GenerationServerConfig(model_path="/m", api_key="sk-secret", weights_root="/w")
    assert "sk-secret" not in repr(cfg) and cfg.api_key == "sk-secret"
    with pytest.raises(ValueError, match=r"api_key='int' is invalid"):
        GenerationServerConfig(model_path="/m", api_key=5)
    with pytest.raises(ValueError, match=r"weights_root='' is invalid"):
        GenerationServerConfig(model_path="/m", weights_root="")
