"""The gserver manager as a worker (type ``gserver_manager``).

Runs a :class:`~realhf.system.rollout.manager.state.GserverManager` behind HTTP
(:mod:`realhf.system.rollout.manager.service`) in a service thread, publishes the address under
``names.gen_server_manager``, starts admitting once the trainer announced where it starts,
and saves the manager's counters periodically so a resumed run continues them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from realhf.api.core.rollout_config import GserverManagerConfig, WeightSync
from realhf.base import constants, name_resolve, names
from realhf.base.storage.atomic_file import write_json_atomic
from realhf.system.rollout.manager.service import ManagerService
from realhf.system.rollout.manager.state import GserverManager
from realhf.system.rollout.staleness import NameResolveProgress
from realhf.system.worker.base import PollResult, Worker, experiment_ended, register_worker

__all__ = ["GserverManagerWorker"]


def _published_at(mode: WeightSync, role: str, version: int, exp: str, trial: str) -> str:
    """What the servers load version ``version`` of ``role`` from: a HF directory, a flat file
    in shared memory, or the address of the trainer's weight sender (any version: it serves
    the one it staged last)."""
    if mode == WeightSync.SHM:
        return constants.weight_shm_path(role, version, exp, trial)
    if mode == WeightSync.BROADCAST:
        return name_resolve.get(names.weight_sender(exp, trial, role))
    return constants.weight_publication_dir(role, version, exp, trial)


@register_worker("gserver_manager")
class GserverManagerWorker(Worker):
    """Runs a :class:`GserverManager` behind HTTP in a service thread (see the module docstring)."""

    config_class = GserverManagerConfig

    # What _exit_hook touches, None until built: shutdown must work from any state,
    # also before configure or after a configure that raised half-way.
    manager: Optional[GserverManager] = None
    service: Optional[ManagerService] = None
    _key: Optional[str] = None

    def _configure(self, config: GserverManagerConfig) -> None:
        from realhf.base.net import network

        exp, trial, role = self.experiment_name, self.trial_name, config.model_role
        progress = NameResolveProgress(exp, trial, role)
        manager = GserverManager(
            config,
            progress,
            discover=lambda: name_resolve.get_subtree(names.gen_servers(exp, trial)),
            weight_dir=lambda v: _published_at(config.weight_sync, role, v, exp, trial),
        )
        # Admission starts once the trainer says where it starts (names.trainer_start):
        # a resumed trainer has trained samples already, and indices must continue there.
        manager.trainer_ready = False
        self.manager = manager
        self.state_path = config.state_path or os.path.join(
            constants.run_dir(), "gserver_manager_state.json"
        )
        self._trainer_deadline = time.monotonic() + config.server_wait_timeout_s
        host = config.host or network.gethostip()
        self.service = ManagerService(manager, host, config.port).start(
            config.server_wait_timeout_s + 60
        )
        self._key = names.gen_server_manager(exp, trial)
        name_resolve.add(
            self._key, self.service.address, keepalive_ttl=self.status_ttl, replace=True
        )
        self._next_save = time.monotonic() + config.state_save_interval_s
        self._next_status_check = 0.0
        self.logger.info(f"gserver manager at {self.service.url}")

    def _poll(self) -> PollResult:
        self.service.check()  # re-raises a failure of the background loops (e.g. a weight update)
        now = time.monotonic()
        if not self.manager.trainer_ready and now >= self._next_status_check:
            self._wait_for_trainer(now)
        if now >= self._next_save:
            self._save_state()
            self._next_save = now + self.config.state_save_interval_s
        if now >= self._next_status_check:
            self._next_status_check = now + 1.0
            if experiment_ended(self.experiment_name, self.trial_name):
                self.logger.info("the experiment ended; the manager stops")
                return PollResult(completed=True)
        time.sleep(0.05)
        return PollResult()

    def _wait_for_trainer(self, now: float) -> None:
        key = names.trainer_start(self.experiment_name, self.trial_name)
        try:
            start = json.loads(name_resolve.get(key))
        except name_resolve.NameEntryNotFoundError:
            if now > self._trainer_deadline:
                raise TimeoutError(
                    f"gserver manager: the trainer did not announce its start ({key!r}) within "
                    f"{self.config.server_wait_timeout_s:g}s; check the master_worker and "
                    "model_worker logs"
                ) from None
            return
        trained = int(start["trained_samples"])
        state = None
        # The saved counters belong to this run only when the trainer resumed it; a fresh
        # run (maybe with another batch size) starts them anew and overwrites the file.
        if start.get("checkpoint") and os.path.exists(self.state_path):
            with open(self.state_path) as f:
                state = json.load(f)

        def begin():
            m = self.manager
            if state is not None or trained > 0:
                m.load_state_dict(state or m.state_dict(), trained)
            m.trainer_ready = True

        self.service.call(begin)
        self.logger.info(
            f"the trainer starts at {trained} trained samples, version {start['version']}"
            + (f" (resumed from {start['checkpoint']})" if start.get("checkpoint") else "")
            + (f"; counters of {self.state_path} restored" if state else "")
            + "; admitting rollouts"
        )

    def _save_state(self) -> None:
        # Until the trainer's start is read the counters are fresh zeros, not this run's:
        # saving them would overwrite the file a resumed run is about to restore from
        # (a trainer that takes longer than one save interval to start is normal).
        if not self.manager.trainer_ready:
            return
        path = self.state_path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        state = self.service.call(self.manager.state_dict)
        write_json_atomic(path, state)

    def _exit_hook(self) -> None:
        # Each resource is None until built (class attributes above).
        if self.service is None:
            return
        try:
            self._save_state()
        finally:
            self.service.stop()
            if self._key is not None:
                try:
                    name_resolve.delete(self._key)
                except Exception:  # expired or cleared with the trial
                    pass
