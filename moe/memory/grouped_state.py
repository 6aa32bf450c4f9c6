"""GroupedApply's state in and out: per-parameter state (the inner optimizer's, plus "master"
with fp32 masters), loading it by parameter index, and the torch-style state_dict. Under
offload the host tensors hold this rank's shard; `state_of` shows them laid out like their
DTensor parameter, so checkpoints and the rebalancer see offloaded state as any other.

GroupedState is a mixin of GroupedApply (moe/memory/grouped_apply.py), which owns the entries,
the apply groups and their inner optimizers that these methods read and refill.
"""

from collections.abc import Iterator, Mapping

import torch
from torch.distributed.tensor import DTensor

from moe.shards import dtensor_like, local


def hyper(group: dict) -> dict:
    """A param group's hyperparameters (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


class StateView(Mapping):
    """`opt.state[param]`: the inner optimizer's state of that parameter (read-only map)."""

    def __init__(self, opt: "GroupedState"):  # a GroupedApply
        self._opt = opt

    def __getitem__(self, param):
        entry = self._opt._entry_of(param)
        return self._opt._inner_of(entry).state[entry.shadow]

    def __iter__(self) -> Iterator:
        return (e.param for e in self._opt._entries if e.shadow in self._opt._inner_of(e).state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class GroupedState:
    """state_of / load_param_states / state_dict / load_state_dict of GroupedApply."""

    def state_of(self, param_or_index) -> dict[str, torch.Tensor]:
        """Optimizer state of one parameter (inner state, plus "master" with fp32 masters)."""
        if isinstance(param_or_index, int):
            entry = self._entries[param_or_index]
        else:
            entry = self._entry_of(param_or_index)
        state = dict(self._inner_of(entry).state.get(entry.shadow, {}))
        if entry.master is not None:
            state["master"] = entry.master
        if self.offload is not None and isinstance(entry.param, DTensor):
            state = {k: as_dtensor_like(v, entry.param) for k, v in state.items()}
        return state

    @torch.no_grad()
    def load_param_states(self, states: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Set the state of parameters by index (as from `state_of`). Parameters without an
        entry get empty state; host copies and masters without a saved "master" are
        refreshed from the (already loaded) parameters."""
        for g, (entries, inner) in enumerate(zip(self._groups, self._inner)):
            inner_state = {}
            for j, e in enumerate(entries):
                state = dict(states.get(e.index, {}))
                if self.offload is not None:  # host state holds this rank's shard
                    state = {
                        k: local(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()
                    }
                master = state.pop("master", None)
                if e.master is not None and master is not None:
                    local(e.master).copy_(master)
                elif e.master is not None:
                    local(e.master).copy_(local(e.param))
                if e.shadow is not e.param and e.shadow is not e.master:
                    e.shadow.copy_(local(e.master if e.master is not None else e.param))
                if state:
                    inner_state[j] = state
            groups = inner.state_dict()["param_groups"]
            inner.load_state_dict({"state": inner_state, "param_groups": groups})
            self._inner[g] = inner
        self._state_pinned = False
        self._pin_host_state()

    def state_dict(self) -> dict:
        return {
            "state": {e.index: s for e in self._entries if (s := self.state_of(e.index))},
            "param_groups": [
                {**hyper(g), "params": [e.index for e in es]}
                for g, es in zip(self.param_groups, self._groups)
            ],
            "names": self.param_names,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        names = state_dict.get("names")
        if names is not None and len(names) != len(self._entries):
            raise ValueError(
                f"state_dict has {len(names)} parameters, this optimizer {len(self._entries)}"
            )
        states = {
            int(i): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in state_dict["state"].items()
        }
        self.load_param_states(states)
        self.load_hyperparameters([hyper(g) for g in state_dict["param_groups"]])
        if self.loss_scaler is not None and state_dict.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    def load_hyperparameters(self, saved: list[dict]) -> None:
        """Per group when the group counts match; else the saved groups must agree."""
        if not saved:
            return
        if len(saved) != len(self.param_groups):
            if any(s != saved[0] for s in saved):
                raise ValueError(
                    f"cannot map {len(saved)} saved groups with different hyperparameters "
                    f"onto {len(self.param_groups)} apply groups"
                )
            saved = [saved[0]] * len(self.param_groups)
        for group, values in zip(self.param_groups, saved):
            group.update(values)


def as_dtensor_like(value, param: DTensor):
    """A host tensor of `param`'s local shape as a DTensor laid out like `param` (sharing
    its storage), so checkpoints and the rebalancer see offloaded state as they see any
    DTensor state; anything else (the 0-dim step count) as it is."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if value.dim() == 0 or value.shape != param.to_local().shape:
        return value
    return dtensor_like(value, param)
