"""What a transformers decoder hands each of its layers, recorded from the decoder's own forward
(moe.pipeline.hf_stack): no per-family table of masks, rotary embeddings or position ids.

Pipeline stages exchange only the hidden state, so a stage must rebuild every other input of its
layers (the causal or sliding-window mask each layer's type takes, position ids, the rotary
embedding's cos / sin, ...). `LayerInputs` runs the decoder's own forward with `inputs_embeds`
of the hidden state's shape and every layer replaced by a recorder (returns its input), the
final norm by an identity: the arguments each layer received are what the model computes, for
any family. They depend on the shape, dtype and device only (checked when the stack is built:
`check_split`), so they are recorded once per shape.

`check_split` runs the whole model once on a few tokens with the recorders in place and refuses,
naming why, a model whose forward does more between its parts than the stack carries: layers
called otherwise than once each in order, embeddings transformed before the first layer (e.g.
a multiplier), logits computed otherwise than lm_head(norm(h)) (e.g. a logit scale), or a layer
input computed from the token ids rather than the hidden state's shape (e.g. multimodal
position ids, hash routing).
"""

import torch
from torch import nn

HIDDEN_NAMES = ("hidden_states", "hidden_state", "hidden")


class _Recorder(nn.Module):
    """Decoder layer `index` while the decoder's forward is recorded: its call's arguments go
    to `calls`, its input hidden state comes back. Other attributes read through to the layer
    (a decoder may ask its layers for their attention type)."""

    def __init__(self, layer: nn.Module, index: int, calls: list):
        super().__init__()
        self._target, self._index, self._calls = (layer,), index, calls

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._target[0], name)

    def forward(self, *args, **kwargs):
        self._calls.append((self._index, args, kwargs))
        if args:
            return args[0]
        return next(kwargs[n] for n in HIDDEN_NAMES if n in kwargs)


def split_hidden(args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.Tensor]:
    """A layer call's (other positional args, other keyword args, hidden state)."""
    if args:
        return args[1:], kwargs, args[0]
    name = next(n for n in HIDDEN_NAMES if n in kwargs)
    return (), {k: v for k, v in kwargs.items() if k != name}, kwargs[name]


def recorded(decoder: nn.Module, norm_name: str, run, keep_norm: bool) -> list:
    """The layer calls (index, args, kwargs) while `run()` runs with the decoder's layers
    replaced by recorders (and its final norm by an identity unless keep_norm)."""
    calls: list = []
    layers = decoder.layers
    norm = getattr(decoder, norm_name)
    decoder.layers = nn.ModuleList(_Recorder(m, i, calls) for i, m in enumerate(layers))
    if not keep_norm:
        setattr(decoder, norm_name, nn.Identity())
    try:
        run()
    finally:
        decoder.layers = layers
        setattr(decoder, norm_name, norm)
    return calls


class LayerInputs:
    """Every layer's arguments but the hidden state, per input shape, from the decoder's own
    forward (shared by the stack's layer children; a copy of a child shares it too)."""

    def __init__(self, decoder: nn.Module, norm_name: str):
        self.decoder, self.norm_name = decoder, norm_name
        self.cache: dict = {}
        self.options: dict = {}  # the flags the model's forward calls the decoder with

    def __deepcopy__(self, memo):
        return self

    def __call__(self, hidden: torch.Tensor) -> list[tuple[tuple, dict]]:
        key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        if key not in self.cache:
            self.cache[key] = self.compute(hidden.new_zeros(hidden.shape))
        return self.cache[key]

    @torch.no_grad()
    def compute(self, embeds: torch.Tensor) -> list[tuple[tuple, dict]]:
        def run():
            self.decoder(inputs_embeds=embeds, **{**self.options, "use_cache": False})

        calls = recorded(self.decoder, self.norm_name, run, keep_norm=False)
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


def check_split(model, decoder, embed, norm, lm_head, inputs: LayerInputs) -> None:
    """Run `model` once on a few tokens with recording layers and refuse (one ValueError
    naming why) what the stack would not compute as the model does."""
    vocab = embed.weight.shape[0]
    ids = (torch.arange(1, 5, device=embed.weight.device) % vocab).unsqueeze(0)
    seen: dict = {}

    def flags(module, args, kwargs):  # plain options (not tensors, not None) replayed later
        inputs.options = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))}

    hooks = [embed.register_forward_hook(lambda m, a, out: seen.setdefault("embeds", out))]
    hooks.append(decoder.register_forward_pre_hook(flags, with_kwargs=True))
    was_training = model.training
    model.eval()  # no dropout between the parts
    try:
        calls = recorded(
            decoder,
            inputs.norm_name,
            lambda: seen.setdefault("out", model(input_ids=ids, use_cache=False)),
            True,
        )
    except Exception as e:  # noqa: BLE001 - what the layers return is not what the next takes
        _refuse(model, f"its forward fails when each layer returns only the hidden state "
                f"({type(e).__name__}: {e}): its layers pass more than the hidden state on "
                "(e.g. the previous layer's attention indices)")  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    L = len(decoder.layers)
    if [i for i, _, _ in calls] != list(range(L)):
        _refuse(model, f"its forward calls its {L} layers as {[i for i, _, _ in calls]}, not "
                "once each in order")  # fmt: skip
    embeds = seen["embeds"]
    for i, args, kwargs in calls:
        other_args, other_kwargs, hidden = split_hidden(args, kwargs)
        if not _same(hidden, embeds):
            where = "before its first layer" if i == 0 else f"between layers {i - 1} and {i}"
            _refuse(model, f"its forward changes the hidden state {where} (e.g. an embedding "
                    "multiplier): the stack passes each layer's output on unchanged")  # fmt: skip
        for name, value in [*enumerate(other_args), *other_kwargs.items()]:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                _refuse(model, f"layer {i}'s input {name!r} is computed from parameters or the "
                        "embeddings: the stages pass only the hidden state")  # fmt: skip
    with torch.no_grad():
        want = lm_head(norm(embeds))
    got = seen["out"].logits
    if got.dtype != want.dtype:
        _refuse(model, f"its logits are {got.dtype}, lm_head's output {want.dtype}: the stack's "
                "head computes lm_head(final norm(hidden)) alone")  # fmt: skip
    if not _same(got, want):
        _refuse(model, "its logits are not lm_head(final norm(hidden)) (e.g. a logit scale or "
                "soft-capping): the stack's head computes exactly that")  # fmt: skip
    rebuilt = inputs.compute(torch.zeros_like(embeds))
    for (i, args, kwargs), (r_args, r_kwargs) in zip(calls, rebuilt):
        other_args, other_kwargs, _ = split_hidden(args, kwargs)
        keys = sorted(set(other_kwargs) | set(r_kwargs))
        differ = [k for k in keys if not _same(other_kwargs.get(k), r_kwargs.get(k))]
        if not _same(other_args, r_args):
            differ.append("positional arguments")
        if differ:
            _refuse(model, f"layer {i}'s inputs {differ} differ when the decoder computes "
                    "them from the hidden state's shape alone (the model computes them from "
                    "the token ids, e.g. multimodal position ids or hash routing)")  # fmt: skip
