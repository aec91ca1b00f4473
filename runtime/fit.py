"""The fit scale (docs/fit.md, "On your GPUs"): an experiment's own full-scale layers on the
GPUs a machine has, as many as fit. The layer is the study's (width, heads, MLP, sequence, micro
batch per device, dtypes, NVFP4, placement, XLA flags); the layer count is the largest whose
compiled program fits a budget of device and pinned host memory, found from a few programs
compiled without allocating anything (memory is close to linear in layers: two give the
slope, a third confirms, a fourth shows one more does not fit). On a machine with pinned host
memory the state moves there where that lets more layers fit, the optimizer state first, then
the layers' weights and gradients. Where even the fewest layers do not fit with all of it
there, the fit reduces, in this order, each said in the run's header: the routed experts
(top-k and expert width kept: an MoE layer's weights are mostly its experts), the vocabulary of
the embedding and head. The tagged tensors keep the
study's shapes: they are what the technique is about."""

import dataclasses
import math
import time
from collections.abc import Callable

from configs import ConfigError
from runtime.own_program import GiB, CompiledMemory, size_words

MARGIN = 0.10  # of XLA's pool and of pinned host memory: fragmentation, what runs beside a step
# XLA keeps an offloaded value in host memory only in a loop that runs more than once (at one
# layer Q/K/V stay on the device: docs/fit.md), so each layer scan keeps two layers at least.
PER_SCAN = 2
VOCAB_STEP = 1024
UNBOUNDED = 2**62


class FitError(ConfigError):
    """Nothing fits, or a layer count set on the command line does not (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one device's compiled program may hold: device bytes and pinned host bytes."""
    device: int
    host: int
    device_words: str
    host_words: str

    def fits(self, memory: CompiledMemory) -> bool:
        return memory.device <= self.device and memory.host <= self.host

    def load(self, memory: CompiledMemory) -> float:
        """The larger share of its budget either memory takes (1: just fits)."""
        return max(memory.device / self.device, memory.host / max(self.host, 1))


def budget(fit_memory: float, pool: int | None, host_limit: int, per_process: int) -> Budget:
    """`fit_memory` GiB if set, else `pool` (XLA's, per device; None: not bounded) less the
    margin; `host_limit` bytes of pinned host memory a process may hold, shared by its
    `per_process` devices, less the margin."""
    if fit_memory:
        device, words = int(fit_memory * GiB), f"fit_memory={fit_memory:g} GiB"
    elif pool is None:  # preset=auto off a GPU: nothing to read a bound from
        device, words = UNBOUNDED, "not bounded: no memory pool here; fit_memory=GiB sets one"
    else:
        device = int(pool * (1 - MARGIN))
        words = f"XLA's pool of {size_words(pool)} less {MARGIN:.0%}"
    host = int(host_limit / per_process * (1 - MARGIN))
    shared = f" over {per_process} devices" if per_process > 1 else ""
    return Budget(device, host, words if device == UNBOUNDED else f"{size_words(device)} ({words})",
                  f"{size_words(host)} ({size_words(host_limit)} of pinned host memory a "
                  f"process may hold{shared}, less {MARGIN:.0%})")


@dataclasses.dataclass(frozen=True)
class Fit:
    """What a fit adds to the experiment's settings (`words`, key -> value) and what it found:
    the chosen program's memory, one more layer's (None: no layer to add, or the count was set),
    the budget, the compiles it took; `recorded`: a resumed checkpoint's, not searched."""
    words: dict[str, str]
    base: object  # the model it reduces: the experiment's with the command line's words
    memory: CompiledMemory | None = None
    over: CompiledMemory | None = None
    budget: Budget | None = None
    compiles: int = 0
    seconds: float = 0.0
    recorded: bool = False

    @property
    def layers(self) -> int:
        return int(self.words["model.n_layers"])

    def found(self) -> str:
        """How: a search's compiles and seconds, or the resumed checkpoint's."""
        if self.recorded:
            return "the checkpoint's (resumed), checked in 1 compile"
        return (f"found in {self.compiles} compile{'s' if self.compiles > 1 else ''}, "
                f"{self.seconds:.1f} s")

    def word_list(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.words.items()]

    def reductions(self) -> list[str]:
        """What besides the layer count it reduces, in words."""
        return reductions(self.words, self.base)


def reductions(words: dict[str, str], model) -> list[str]:
    said = []
    if words.get("optimizer_state") == "host":
        said.append("the optimizer state in host memory (optimizer_state=host)")
    if words.get("parameters") == "host":
        said.append("the layers' weights and gradients in host memory (parameters=host)")
    if (experts := int(words.get("model.n_experts", 0))) and experts != model.n_experts:
        said.append(f"routed experts {experts} of {model.n_experts} (top-k "
                    f"{model.experts_per_token} and expert width {model.moe_d_ff} kept)")
    if (vocab := int(words.get("model.vocab", 0))) and vocab != model.vocab:
        said.append(f"vocabulary {vocab:,} of {model.vocab:,}")
    return said


def largest(values: list[int], measure: Callable[[int], CompiledMemory],
            budget: Budget) -> int | None:
    """The index of the largest of the ascending `values` whose program fits (None: not even
    the first): the ends measured, then guesses interpolated between the largest that fits and
    the smallest that does not, until they are neighbours."""
    if not budget.fits(measure(values[0])):
        return None
    if budget.fits(measure(values[-1])):
        return len(values) - 1
    low, high = 0, len(values) - 1
    while high - low > 1:
        a, b = budget.load(measure(values[low])), budget.load(measure(values[high]))
        guess = low + math.floor((1 - a) / (b - a) * (high - low)) if b > a else low + 1
        guess = min(max(guess, low + 1), high - 1)
        if budget.fits(measure(values[guess])):
            low = guess
        else:
            high = guess
    return low


STATE = ("optimizer_state", "parameters")  # the state's parts a fit may move to host, in order


def knobs(model, run, fixed: set[str], shards: int, host_state: bool) -> list:
    """The reductions this run may take, in order, each as (its words per value, the values,
    ascending): those its command line set are not taken. The state's moves to host memory
    come first (each says `STATE`'s key: they change no shape of the model)."""
    found = []
    for part in STATE:  # the state to host memory: the moments, then the weights
        if host_state and getattr(run, part) == "device" and part not in fixed:
            found.append((lambda _, part=part: {part: "host"}, [1]))
    if hasattr(model, "n_experts") and "model.n_experts" not in fixed:
        step = math.lcm(model.n_groups, shards)  # (experts are sharded over fsdp x expert)
        per_group = max(2, math.ceil(model.experts_per_token / model.topk_groups))
        first = math.ceil(model.n_groups * per_group / step) * step
        found.append((lambda e: {"model.n_experts": str(e)},
                      [*range(first, model.n_experts, step), model.n_experts]))
    if not run.data.path and "model.vocab" not in fixed:  # a tokenizer's vocabulary stays
        found.append((lambda v: {"model.vocab": str(v)},
                      [*range(VOCAB_STEP, model.vocab, VOCAB_STEP), model.vocab]))
    return found


def layer_problem(model, fixed: set[str]) -> str | None:
    """Why the command line's dense layer count leaves a fit too few MoE layers; None: it
    does not."""
    dense = getattr(model, "n_dense_layers", None)
    if "model.n_dense_layers" in fixed and dense + PER_SCAN > model.n_layers:
        return (f"model.n_dense_layers={dense} leaves fewer than {PER_SCAN} of the "
                f"{model.n_layers} layers to the MoE scan, which a fit keeps")
    return None


def layer_words(model, fixed: set[str], full: int) -> tuple[Callable[[int], dict], list[int]]:
    """(the words for L layers, the counts to try, up to the experiment's `full` count): at least
    PER_SCAN layers per scan; a DeepSeek model's dense layers first, as many as the
    experiment's, the rest MoE."""
    dense = getattr(model, "n_dense_layers", None)
    kept = "model.n_dense_layers" in fixed  # (then every count tried has those dense layers)
    first = PER_SCAN if dense is None else (dense if kept else min(dense, PER_SCAN)) + PER_SCAN

    def words(layers: int) -> dict[str, str]:
        said = {"model.n_layers": str(layers)}
        if dense is not None and "model.n_dense_layers" not in fixed:
            said["model.n_dense_layers"] = str(max(1, min(dense, layers - PER_SCAN)))
        return said
    return words, list(range(min(first, full), full + 1))


def search(model, run, budget: Budget, measure: Callable[[dict], tuple], fixed: set[str],
           shards: int, host_state: bool, full: int) -> tuple[Fit, object]:
    """The fit of `model` and `run` (the experiment's with the command line's words, on the
    machine's mesh; `full` its layer count) within `budget`: (the fit, what `measure` returned
    for its program). `measure(words)` compiles the run with those words and returns (its
    CompiledMemory, the program); `fixed`: the keys the command line set, never reduced; a
    layer count it set is checked, and if it does not fit, the line names how many do."""
    started, seen = time.perf_counter(), {}

    def key(words: dict) -> tuple:
        """The words that change the run: one that sets what it has already (a reduction's
        last value, the whole) compiles the same program."""
        return tuple(sorted((k, v) for k, v in words.items() if v != _given(model, run, k)))

    def at(words: dict) -> CompiledMemory:
        if (found := key(words)) not in seen:
            seen[found] = measure(words)
        return seen[found][0]

    per_layers, counts = layer_words(model, fixed, full)
    wanted = model.n_layers if "model.n_layers" in fixed else None
    words, best = {}, None  # best: (layers, words, one more layer's memory)
    for knob in [None, *knobs(model, run, fixed, shards, host_state)]:
        if knob is not None:
            said, values = knob
            if best is not None and not set(said(values[0])) & set(STATE):
                break  # the model is reduced only where no place of the state fits it
            index = largest(values, lambda v: at({**words, **said(v), **per_layers(counts[0])}),
                            budget)
            words = {**words, **said(values[index or 0])}
        if not budget.fits(at({**words, **per_layers(counts[0])})):
            continue  # not even the fewest layers: the next reduction too
        if wanted is not None:
            if budget.fits(at({**words, **per_layers(wanted)})):
                best = (wanted, words, None)
                break
            best = (None, words, None)
            continue  # the state's next move may let it fit
        # Each move of the state to host is kept where it lets more layers fit: as many of
        # the study's layers as fit are the fit's aim. Searched from the last count found.
        start = 0 if best is None else counts.index(best[0])
        found = largest(counts[start:], lambda n: at({**words, **per_layers(n)}), budget)
        index = start + (0 if found is None else found)
        if best is None or (found is not None and counts[index] > best[0]):
            over = (at({**words, **per_layers(counts[index + 1])})
                    if index + 1 < len(counts) else None)
            best = (counts[index], words, over)
        if index + 1 == len(counts):
            break
    if best is None:
        raise FitError(_nothing_fits(model, budget, words, counts, at, per_layers))
    layers, words, over = best
    if layers is None:
        index = largest(counts, lambda n: at({**words, **per_layers(n)}), budget)
        raise FitError(f"model.n_layers={wanted} does not fit: "
                       f"{size_words(at({**words, **per_layers(wanted)}).device)} per device "
                       f"of {budget.device_words}; {counts[index]} layers fit{_with(words, model)}")
    chosen = {**per_layers(layers), **words}
    fit = Fit(chosen, model, at(chosen), over, budget, len(seen), time.perf_counter() - started)
    return fit, seen[key(chosen)][1]


def _given(model, run, key: str) -> str:
    """A fit word's value as the run has it (`model.<field>` from the model, else the run's)."""
    return str(getattr(model, key.removeprefix("model."), None) if key.startswith("model.")
               else getattr(run, key, None))


def _with(words: dict, model) -> str:
    return f" with {'; '.join(said)}" if (said := reductions(words, model)) else ""


def _nothing_fits(model, budget, words, counts, at, per_layers) -> str:
    fewest = at({**words, **per_layers(counts[0])})
    line = (f"even {counts[0]} layers do not fit: {size_words(fewest.device)} per device of "
            f"{budget.device_words}, {size_words(fewest.host)} in host memory of "
            f"{budget.host_words}{_with(words, model)}")
    # One more layer (a DeepSeek model's: an MoE one): what a layer needs. XLA's schedule is
    # not always larger by a layer (the difference has come out negative): then both, whole.
    more = at({**words, **per_layers(counts[0]), "model.n_layers": str(counts[0] + 1)})
    if more.device <= fewest.device:
        return line + (f"; {counts[0] + 1} layers compile to {size_words(more.device)} per "
                       f"device, no more than {counts[0]}: what one layer needs is not read")
    return line + (f"; one layer needs {size_words(more.device - fewest.device)} per device "
                   f"and {size_words(max(0, more.host - fewest.host))} in host memory")
