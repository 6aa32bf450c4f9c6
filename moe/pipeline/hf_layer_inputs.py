"""A transformers decoder LM run around its layers, from the model's own forward
(moe.pipeline.hf_stack): no per-family table of masks, rotary embeddings, position ids,
embedding scales or logit caps.

Pipeline stages exchange only the hidden state, so each piece of the stack runs the model's own
forward with its decoder layers replaced by stand-ins (`ModelRunner`):
    embed(ids)      the forward up to the first layer; the first stand-in stops it and hands
                    back its input (embeddings, scales, stream expansions: the model's own)
    layer_inputs(h) every layer's other arguments (the mask its type takes, position ids,
                    rotary cos / sin, ...) from the decoder's forward on zeros of h's shape
                    (they depend on the shape, dtype and device only: checked), once per shape
    head(h)         the forward with the last stand-in returning h: what the model does after
                    its last layer (final norm, stream collapse, lm_head, logit scale or cap)

`probe` runs the whole model once on a few tokens with stand-ins that return their input and
records which modules run before, between and after the layers; it refuses, naming why, a model
whose layers are not called once each in order, hand more than the hidden state on, take an
input computed from the token ids (multimodal position ids, hash routing) or from parameters,
or whose forward runs modules with parameters between its layers.
"""

import torch
from torch import nn

HIDDEN_NAMES = ("hidden_states", "hidden_state", "hidden")


class _Stop(Exception):
    """Raised by a stand-in to end the model's forward early, carrying its input."""

    def __init__(self, hidden):
        super().__init__("stopped")
        self.hidden = hidden


class _StandIn(nn.Module):
    """Decoder layer `index` while the model's forward runs around it: `act(index, hidden)`
    gives its output (or raises _Stop); its call's arguments go to `calls`. Other attributes
    read through to the layer (a decoder may ask its layers for their attention type)."""

    def __init__(self, layer: nn.Module, index: int, calls: list, act):
        super().__init__()
        self._target, self._index, self._calls, self._act = (layer,), index, calls, act

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._target[0], name)

    def forward(self, *args, **kwargs):
        self._calls.append((self._index, args, kwargs))
        return self._act(self._index, split_hidden(args, kwargs)[2])


def split_hidden(args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.Tensor]:
    """A layer call's (other positional args, other keyword args, hidden state)."""
    if args:
        return args[1:], kwargs, args[0]
    name = next(n for n in HIDDEN_NAMES if n in kwargs)
    return (), {k: v for k, v in kwargs.items() if k != name}, kwargs[name]


def around_layers(decoder: nn.Module, run, act) -> tuple[list, object]:
    """(the layer calls, run()'s result or the hidden state a stand-in stopped with) while
    `run()` runs with the decoder's layers replaced by stand-ins acting as `act`."""
    calls: list = []
    layers = decoder.layers
    decoder.layers = nn.ModuleList(_StandIn(m, i, calls, act) for i, m in enumerate(layers))
    try:
        out = run()
    except _Stop as stop:
        out = stop.hidden
    finally:
        decoder.layers = layers
    return calls, out


class ModelRunner:
    """The model's forward around its layers (see the module docstring), shared by the stack's
    children (a copy of a child shares it too)."""

    def __init__(self, model: nn.Module, decoder: nn.Module, embed: nn.Module):
        self.model, self.decoder = model, decoder
        self.width = embed.weight.shape[1]
        self.cache: dict = {}
        self.options: dict = {}  # the flags the model's forward calls the decoder with

    def __deepcopy__(self, memo):
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        def stop(i, hidden):
            raise _Stop(hidden)

        return around_layers(
            self.decoder, lambda: self.model(input_ids=ids, use_cache=False), stop
        )[1]

    def head(self, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        last = len(self.decoder.layers) - 1
        zeros = hidden.new_zeros(*hidden.shape[:2], self.width, dtype=dtype)

        def act(i, h):
            return hidden if i == last else h

        run = lambda: self.model(inputs_embeds=zeros, use_cache=False).logits  # noqa: E731
        return around_layers(self.decoder, run, act)[1]

    def layer_inputs(self, hidden: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
        key = (tuple(hidden.shape[:2]), dtype, hidden.device)
        if key not in self.cache:
            self.cache[key] = self.compute(hidden.new_zeros(*key[0], self.width, dtype=dtype))
        return self.cache[key]

    @torch.no_grad()
    def compute(self, embeds: torch.Tensor) -> list[tuple]:
        last = len(self.decoder.layers) - 1

        def act(i, h):
            if i == last:  # every call recorded: nothing after the layers runs here
                raise _Stop(h)
            return h

        run = lambda: self.decoder(inputs_embeds=embeds, **{**self.options, "use_cache": False})  # noqa: E731
        calls, _ = around_layers(self.decoder, run, act)
        return [split_hidden(args, kwargs)[:2] for _, args, kwargs in calls]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a comparison: not the same
        return a is b


def _refuse(model: nn.Module, why: str):
    raise ValueError(f"hf_stack: {type(model).__name__} cannot be split into stages: {why}")


def _owns(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def probe(model, runner: ModelRunner, embed: nn.Module) -> dict:
    """Run `model` once on a few tokens with stand-ins returning their input; refuse (one
    ValueError naming why) what the stack would not compute as the model does. Returns the
    modules the forward runs "before" / "after" the layers and the first layer's input dtype."""
    decoder = runner.decoder
    ids = (torch.arange(1, 5, device=embed.weight.device) % embed.weight.shape[0]).unsqueeze(0)
    L = len(decoder.layers)
    done: list = []  # layers called so far
    ran: dict = {"before": [], "between": [], "after": []}

    def track(module, args):
        if not isinstance(module, _StandIn):
            phase = "before" if not done else "after" if len(done) >= L else "between"
            if all(m is not module for m in ran[phase]):
                ran[phase].append(module)

    def flags(module, args, kwargs):  # plain options (not tensors, not None) replayed later
        runner.options = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))}

    def identity(i, hidden):
        done.append(i)
        return hidden

    was_training = model.training
    model.eval()  # no dropout between the parts
    try:
        return _probe(model, runner, ids, L, ran, track, flags, identity)
    finally:
        model.train(was_training)


def _probe(model, runner, ids, L, ran, track, flags, identity) -> dict:
    decoder = runner.decoder
    hooks = [nn.modules.module.register_module_forward_pre_hook(track)]
    hooks.append(decoder.register_forward_pre_hook(flags, with_kwargs=True))
    try:
        run = lambda: model(input_ids=ids, use_cache=False).logits  # noqa: E731
        got_calls, logits = around_layers(decoder, run, identity)
    except Exception as e:  # noqa: BLE001 - what the layers return is not what the next takes
        _refuse(model, f"its forward fails when each layer returns only the hidden state "
                f"({type(e).__name__}: {e}): its layers pass more than the hidden state on "
                "(e.g. the previous layer's attention indices)")  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    order = [i for i, _, _ in got_calls]
    if order != list(range(L)):
        _refuse(model, f"its forward calls its {L} layers as {order}, not once each in order")
    between = [m for m in ran["between"] if _owns(m)]
    if between:
        _refuse(model, f"its forward runs {type(between[0]).__name__} (with parameters) between "
                "its layers: the stages pass only the hidden state")  # fmt: skip
    first = split_hidden(*got_calls[0][1:])[2]
    for i, args, kwargs in got_calls:
        other_args, other_kwargs, hidden = split_hidden(args, kwargs)
        if i and not _same(hidden, first):
            _refuse(model, f"its forward changes the hidden state between layers {i - 1} and "
                    f"{i}: the stack passes each layer's output on unchanged")  # fmt: skip
        for name, value in [*enumerate(other_args), *other_kwargs.items()]:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                _refuse(model, f"layer {i}'s input {name!r} is computed from parameters or the "
                        "embeddings: the stages pass only the hidden state")  # fmt: skip
    rebuilt = runner.compute(torch.zeros(*first.shape[:2], runner.width, dtype=first.dtype,
                                         device=first.device))  # fmt: skip
    for (i, args, kwargs), (r_args, r_kwargs) in zip(got_calls, rebuilt):
        other_args, other_kwargs, _ = split_hidden(args, kwargs)
        keys = sorted(set(other_kwargs) | set(r_kwargs))
        differ = [k for k in keys if not _same(other_kwargs.get(k), r_kwargs.get(k))]
        if not _same(other_args, r_args):
            differ.append("positional arguments")
        if differ:
            _refuse(model, f"layer {i}'s inputs {differ} differ when the decoder computes "
                    "them from the hidden state's shape alone (the model computes them from "
                    "the token ids, e.g. multimodal position ids or hash routing)")  # fmt: skip
    with torch.no_grad():
        if not _same(runner.head(first, first.dtype), logits.detach()):
            _refuse(model, "its logits differ when computed from the last layer's output alone")
    return {"before": ran["before"], "after": ran["after"], "dtype": first.dtype}
