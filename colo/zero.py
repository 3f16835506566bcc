"""ZeRO-1 over ranks: each rank steps 1/world of the fp32 master weights and optimizer state, and the
updated weights are all-gathered straight into the weights every rank serves.

    opt = colo.ShardedMasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-5,
                                            store_region=pool.regions["weights"])
    loss.backward()                        # fp32 main gradients, full size on every rank
    opt.clip_grad_norm_(1.0)               # reduce-scatter: each rank gets its shard's mean gradient
    opt.step(); opt.zero_grad()            # AdamW on the shard; its weights all-gathered in place
    shared.publish()                       # the engine serves them (nothing copied)

The parameters, ordered by address, form one flat "store". When they lie in one pool region with
nothing but their own padding between them (the engine's weights as colo loads them: fused
`qkv_proj` rows, embedding padding rows, the region's allocation rounding), the store is that memory
itself, and `all_gather_into_tensor` writes every rank's updated shard directly into the weights the
engine and the trainer share: the collective ZeRO needs anyway is the hand-off. Otherwise (ordinary
tensors) the store is a private buffer and the gathered values are copied into the parameters.

Rank r steps store elements [r S, (r+1) S), S = N // world, plus the last N % world elements, which
every rank steps identically (each with the averaged gradient), so collectives stay even-sized.
Only elements of trainable parameters have masters; the padding between them is gathered as it is.

16-bit parameters get fp32 masters (in `master_region`, beside the optimizer state); fp32
parameters are their own masters (the store elements themselves). The fp32 main gradients cover the
whole store (in `grad_region`); hooks add each parameter's gradient into them as autograd produces it.

state_dict() is this rank's shard in the coordinates of the parameters (their concatenation in the
order given), so load_state_dict() accepts the shards of a run with another number of ranks (or an
unsharded colo.MasterWeightOptimizer's state) and takes the pieces this rank now steps.
"""
from __future__ import annotations

import bisect
import ctypes
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .clipping import clip_, gradients_finite
from .mixed_precision import MainGradientOptimizer, MasterRounding, checked_params, fp32_buffer, param_groups
from .sizes import round_up

FORMAT = "colo.zero/1"
_TRAINABLE = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Piece:
    """The part of parameter `param` that this rank steps: store elements [start, stop)."""
    param: int
    start: int
    stop: int
    param_space: int  # where `start` lies in the concatenation of all parameters (checkpoint coordinates)

    @property
    def numel(self) -> int:
        return self.stop - self.start


class ShardLayout:
    """Where each parameter lies in the flat store and which pieces of it rank `rank` of `world_size` steps.

    Computed without allocating anything, so budgets can be sized before the optimizer exists.
    """

    def __init__(self, params: list[torch.Tensor], world_size: int, rank: int, *, store_region=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.world_size, self.rank = world_size, rank
        self.dtype, self.device = params[0].dtype, params[0].device
        for i, p in enumerate(params):
            if p.dtype != self.dtype or p.device != self.device:
                raise TypeError(f"parameter {i} is {p.dtype} on {p.device}, parameter 0 {self.dtype} on "
                                f"{self.device}: a sharded optimizer needs one dtype and device")
        self.param_numels = [p.numel() for p in params]
        self.in_place = store_region is not None and _alias_store(params, store_region) is not None
        if self.in_place:
            base = min(p.data_ptr() for p in params)
            self.base_address = base
            self.starts = [(p.data_ptr() - base) // p.element_size() for p in params]
            self.numel = max(s + p.numel() for s, p in zip(self.starts, params))
        else:  # a private store: parameters one after another, in the order given
            self.base_address = None
            self.starts = _prefix_sums(self.param_numels)
            self.numel = sum(self.param_numels)
        self.shard_numel = self.numel // world_size
        self.tail_start = self.shard_numel * world_size
        owned = [(rank * self.shard_numel, (rank + 1) * self.shard_numel), (self.tail_start, self.numel)]
        param_space = _prefix_sums(self.param_numels)
        self.pieces: list[Piece] = []
        for i in sorted(range(len(params)), key=lambda i: self.starts[i]):
            first, last = self.starts[i], self.starts[i] + self.param_numels[i]
            for lo, hi in owned:
                start, stop = max(first, lo), min(last, hi)
                if start < stop:
                    self.pieces.append(Piece(i, start, stop, param_space[i] + start - first))

    @property
    def owned_numel(self) -> int:
        """Elements this rank keeps masters and optimizer state for."""
        return sum(piece.numel for piece in self.pieces)


class ShardedMasterWeightOptimizer(MainGradientOptimizer):
    """`optimizer_class` over this rank's shard of fp32 masters of `params`; see the module docstring.

    group: the torch.distributed process group (None: the default one; a single process without
    torch.distributed is a world of one). store_region: the colo.Region holding the parameters (the
    pool's `weights` region), which lets the all-gather land in them directly. master_region /
    grad_region: colo.Regions for the masters and the main gradients (None: torch allocates them).
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, group=None, store_region=None,
                 master_region=None, grad_region=None, layout: ShardLayout | None = None, rounding: str = "nearest",
                 seed: int = 0, **optimizer_kwargs):
        groups = param_groups(params)
        self.params = checked_params(groups, "ShardedMasterWeightOptimizer", _TRAINABLE)
        self.group = group
        world_size, rank = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
        self.layout = layout or ShardLayout(self.params, world_size, rank, store_region=store_region)
        if (self.layout.world_size, self.layout.rank) != (world_size, rank):
            raise ValueError(f"the layout is for rank {self.layout.rank} of {self.layout.world_size}, this process is "
                             f"rank {rank} of {world_size}")
        lay = self.layout
        self.rounding = MasterRounding(rounding, seed)
        starts = _prefix_sums(lay.param_numels)   # (each piece rounded as the part of its parameter it is)
        self._rounded_pieces = [(p.param, p.param_space - starts[p.param], lay.param_numels[p.param]) for p in lay.pieces]
        self.store = self._build_store()
        self.grad_flat = fp32_buffer(grad_region, lay.numel, lay.device).zero_()
        self.main_grads = [self.grad_flat[s:s + p.numel()].view_as(p) for s, p in zip(lay.starts, self.params)]
        self.store_pieces = [self.store[piece.start:piece.stop] for piece in lay.pieces]
        self.master_weights = lay.dtype != torch.float32
        with torch.no_grad():
            if self.master_weights:
                self.master_flat = fp32_buffer(master_region, lay.owned_numel, lay.device)
                self.masters = list(self.master_flat.split([piece.numel for piece in lay.pieces]))
                torch._foreach_copy_(self.masters, self.store_pieces)
            else:  # fp32: the store's own elements are stepped
                self.master_flat, self.masters = None, self.store_pieces
        for master, piece in zip(self.masters, lay.pieces):
            master.grad = self.grad_flat[piece.start:piece.stop]
        group_of = {id(p): g for g, group_ in enumerate(groups) for p in group_["params"]}
        piece_groups = [group_of[id(self.params[piece.param])] for piece in lay.pieces]
        # Every group, even one whose parameters lie wholly in other ranks' shards (it steps nothing
        # here), so groups line up across ranks for LR schedulers and checkpoints.
        self.optimizer = optimizer_class([{**{k: v for k, v in g.items() if k != "params"},
                                           "params": [m for m, j in zip(self.masters, piece_groups) if j == index]}
                                          for index, g in enumerate(groups)], **optimizer_kwargs)
        self._reduced = False
        self._register_hooks()

    def _build_store(self) -> torch.Tensor:
        lay = self.layout
        if lay.in_place:
            return _tensor_at(lay.base_address, lay.numel, lay.dtype, lay.device)
        store = torch.empty(lay.numel, dtype=lay.dtype, device=lay.device)
        with torch.no_grad():
            for start, p in zip(lay.starts, self.params):
                store[start:start + p.numel()].copy_(p.reshape(-1))
        return store

    # -- what a training loop calls ----------------------------------------------------------------
    @property
    def copied_bytes_per_step(self) -> int:
        """Bytes step() copies besides the all-gather: 0 when the store is the parameters' own memory."""
        return 0 if self.layout.in_place else self.layout.numel * self.store.element_size()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: its masters and the inner optimizer's tensors."""
        total = self.master_flat.numel() * 4 if self.master_flat is not None else 0
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the fp32 main gradients (they stay allocated: the masters' .grad are views of them)."""
        self.grad_flat.zero_()
        for p in self.params:
            p.grad = None
        self._reduced = False
        self._grad_norm = None

    def reduce_gradients(self) -> None:
        """Average the main gradients over ranks: this rank's shard by reduce-scatter (in place),
        the tail by all-reduce. step() and clip_grad_norm_() call it once per step."""
        if self._reduced:
            return
        lay, world = self.layout, self.layout.world_size
        if world > 1:
            shard = self.grad_flat[lay.rank * lay.shard_numel:(lay.rank + 1) * lay.shard_numel]
            if lay.shard_numel:
                _reduce_scatter_into(shard, self.grad_flat[:lay.tail_start], self.group)
                shard.div_(world)
            if lay.tail_start < lay.numel:
                tail = self.grad_flat[lay.tail_start:]
                dist.all_reduce(tail, group=self.group)
                tail.div_(world)
        self._reduced = True

    def clip_grad_norm_(self, max_norm: float | None, *, weights: dict | None = None, sum_group=None) -> float:
        """The fp32 L2 norm of the averaged gradient over all ranks; scales this rank's pieces to
        `max_norm` when above it (None: no clip).

        weights: {parameter index: w} multiplying that parameter's squares, and sum_group a group the
        squares are then summed over as well: a tensor-parallel model's parameters are shards of the
        whole model's, summed over its tensor-parallel group, with the parameters every rank holds
        whole counted once (colo.tensor_parallel.TensorParallelModel.norm_weights)."""
        self.reduce_gradients()
        lay = self.layout
        shard = self.grad_flat[lay.rank * lay.shard_numel:(lay.rank + 1) * lay.shard_numel]
        tail = self.grad_flat[lay.tail_start:]
        if weights is None:
            squares = torch.linalg.vector_norm(shard, dtype=torch.float32) ** 2
            tail_squares = float(torch.linalg.vector_norm(tail, dtype=torch.float32)) ** 2
        else:
            squares, tail_squares = self._weighted_squares(weights)
        if lay.world_size > 1:
            squares = squares.to(torch.float64)
            dist.all_reduce(squares, group=self.group)
        total = float(squares) + float(tail_squares)
        if sum_group is not None:
            summed = torch.tensor(total, dtype=torch.float64, device=shard.device)
            dist.all_reduce(summed, group=sum_group)
            total = float(summed)
        norm = math.sqrt(total)
        clip_([shard, tail], norm, max_norm)  # not finite: left as they are, and step() skips
        self._grad_norm = norm
        return norm

    def _gradients_finite(self) -> bool:
        """Every rank's gradients finite (a collective, so that the ranks step or skip together)."""
        finite = torch.tensor(float(gradients_finite([self.grad_flat])), device=self.grad_flat.device)
        if self.layout.world_size > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=self.group)
        return bool(finite)

    def _weighted_squares(self, weights: dict):
        """Sums of squares (fp64) of this rank's shard and of the tail, parameter i's scaled by weights[i]."""
        squares = [torch.zeros((), dtype=torch.float64, device=self.grad_flat.device) for _ in range(2)]
        for piece in self.layout.pieces:
            part = self.grad_flat[piece.start:piece.stop]
            squares[piece.start >= self.layout.tail_start] += weights.get(piece.param, 1.0) * part.double().square().sum()
        return tuple(squares)

    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's shard, round it into the store and all-gather every rank's shard into it; with
        gradients that are not finite on any rank, nothing, on every rank (MainGradientOptimizer._finite_step)."""
        self.reduce_gradients()
        if not self._finite_step():
            self._reduced = False
            return
        self.optimizer.step()
        self._publish_shard()
        self._reduced = False

    def _publish_shard(self) -> None:
        lay = self.layout
        if self.master_weights:
            self.rounding.write(self.store_pieces, self.masters, self._rounded_pieces)
        if lay.world_size > 1 and lay.shard_numel:
            mine = self.store[lay.rank * lay.shard_numel:(lay.rank + 1) * lay.shard_numel]
            _all_gather_into(self.store[:lay.tail_start], mine, self.group)
        if not lay.in_place:
            torch._foreach_copy_([p.data.view(-1) for p in self.params],
                                 [self.store[s:s + p.numel()] for s, p in zip(lay.starts, self.params)])

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard: masters and per-element optimizer state over its pieces, in parameter
        coordinates (see the module docstring), with the scalar state and the groups' settings."""
        lay = self.layout
        per_element, scalars = _flattened_state(self.optimizer.state.get(m, {}) for m in self.masters)
        masters = self.master_flat if self.master_flat is not None else torch.cat(self.masters)
        return {
            "format": FORMAT, "world_size": lay.world_size, "rank": lay.rank, "param_numels": list(lay.param_numels),
            "ranges": torch.tensor([[p.param_space, p.param_space + p.numel] for p in lay.pieces],
                                   dtype=torch.int64).reshape(-1, 2),
            "master_weights": masters.detach().to(torch.float32, copy=True).cpu(),
            "state": per_element, "scalars": scalars, "param_groups": _group_settings(self.optimizer.param_groups),
            **self.rounding.state_dict(),
        }

    def load_state_dict(self, shards) -> None:
        """Load this rank's pieces from `shards`: one state_dict() or a list of them (every rank of a
        run, with any number of ranks), or an unsharded colo.MasterWeightOptimizer's state_dict().
        Collective: every rank calls it (the restored weights are gathered like a step's)."""
        shards = [_as_shard(s, self.layout.param_numels) for s in (shards if isinstance(shards, (list, tuple)) else [shards])]
        lay = self.layout
        by_param_space = sorted(range(len(lay.pieces)), key=lambda j: lay.pieces[j].param_space)
        starts = [lay.pieces[j].param_space for j in by_param_space]
        filled = [0] * len(lay.pieces)
        keys = sorted({key for s in shards for key in s["state"]})
        state = {key: [torch.zeros(piece.numel, dtype=torch.float32) for piece in lay.pieces] for key in keys}
        masters = [torch.empty(piece.numel, dtype=torch.float32) for piece in lay.pieces]
        for shard in shards:
            offset = 0
            for begin, end in shard["ranges"].tolist():
                for k in range(max(bisect.bisect_right(starts, begin) - 1, 0), len(lay.pieces)):
                    j = by_param_space[k]
                    piece = lay.pieces[j]
                    lo, hi = max(begin, piece.param_space), min(end, piece.param_space + piece.numel)
                    if piece.param_space >= end:
                        break
                    if lo >= hi:
                        continue
                    src = slice(offset + lo - begin, offset + hi - begin)
                    dst = slice(lo - piece.param_space, hi - piece.param_space)
                    masters[j][dst] = shard["master_weights"][src]
                    for key in keys:
                        if key in shard["state"]:
                            state[key][j][dst] = shard["state"][key][src]
                    filled[j] += hi - lo
                offset += end - begin
        short = [j for j, piece in enumerate(lay.pieces) if filled[j] < piece.numel]
        if short:
            raise ValueError(f"the shards given cover {filled[short[0]]} of the {lay.pieces[short[0]].numel} elements "
                             f"of parameter {lay.pieces[short[0]].param} that rank {lay.rank} steps: pass every "
                             "rank's state_dict() of the run")
        self.rounding.load_state_dict(shards[0])   # (every rank's count of writes is the same)
        self._load_pieces(masters, state, shards[0]["scalars"], shards[0]["param_groups"])

    @torch.no_grad()
    def _load_pieces(self, masters, state, scalars, groups) -> None:
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(f"the state has {len(groups)} parameter groups, this optimizer {len(self.optimizer.param_groups)}")
        # torch numbers the inner optimizer's parameters group by group; the pieces are in store order.
        index = {id(m): i for i, m in enumerate(m for g in self.optimizer.param_groups for m in g["params"])}
        inner_state = {}
        for j, master in enumerate(self.masters):
            entry = {key: values[j].view_as(master) for key, values in state.items()}
            if entry or scalars:
                inner_state[index[id(master)]] = {**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()},
                                                  **entry}
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": [
            {**settings, "params": [index[id(m)] for m in g["params"]]}
            for settings, g in zip(groups, self.optimizer.param_groups)]})
        torch._foreach_copy_(self.masters, [m.to(self.layout.device) for m in masters])
        self._publish_shard()


def _as_shard(state, param_numels: list[int]) -> dict:
    """A state_dict() of this module, or an unsharded MasterWeightOptimizer one turned into a shard
    of a world of one; ValueError if it is neither or belongs to other parameters."""
    if isinstance(state, dict) and state.get("format") == FORMAT:
        if list(state["param_numels"]) != list(param_numels):
            raise ValueError(f"the optimizer state is for {len(state['param_numels'])} parameters of "
                             f"{sum(state['param_numels'])} elements, not these {len(param_numels)} of {sum(param_numels)}")
        return state
    if isinstance(state, dict) and "master_weights" in state and "optimizer" in state:
        inner = state["optimizer"]
        total = sum(param_numels)
        if state["master_weights"].numel() != total or len(inner["state"]) not in (0, len(param_numels)):
            raise ValueError(f"the MasterWeightOptimizer state holds {state['master_weights'].numel()} master "
                             f"elements, these parameters {total}")
        per_element, scalars = _flattened_state(inner["state"][i] for i in range(len(inner["state"])))
        return {"ranges": torch.tensor([[0, total]]), "master_weights": state["master_weights"].reshape(-1).float(),
                "state": per_element, "scalars": scalars, "param_groups": _group_settings(inner["param_groups"])}
    raise ValueError("not a colo optimizer state (expected ShardedMasterWeightOptimizer.state_dict() shards or a "
                     "MasterWeightOptimizer.state_dict())")


# torch 2.13 names them *_single (the *_tensor names still work, with a deprecation warning).
def _flattened_state(per_param_states) -> tuple[dict, dict]:
    """Optimizer state of consecutive parameters (or pieces) as one fp32 CPU tensor per per-element key
    (AdamW's moments), and the scalar entries (AdamW's step: the same for every parameter) once."""
    per_element, scalars = {}, {}
    for state in per_param_states:
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                per_element.setdefault(key, []).append(value.detach().reshape(-1).float())
            elif key not in scalars:
                scalars[key] = value.detach().clone() if torch.is_tensor(value) else value
    return {key: torch.cat(values).cpu() for key, values in per_element.items()}, scalars


def _group_settings(param_groups) -> list[dict]:
    """The groups' hyperparameters without their parameters (which are per rank)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in param_groups]


def _all_gather_into(output: torch.Tensor, mine: torch.Tensor, group) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, mine, group=group)


def _reduce_scatter_into(mine: torch.Tensor, full: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(mine, full, group=group)


def _alias_store(params, region):
    """(lowest address, highest end) if the parameters lie in `region` with nothing between them but
    their own storage or allocation padding, so one tensor over that span can be written; else None."""
    if not all(region.contains(p) for p in params):
        return None
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params)
    if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
        return None  # overlapping parameters: a gather would write one with the other's values
    # The bytes after a storage's end up to the region's next alignment boundary are its own padding;
    # anything further is another allocation's. The region says what it rounds to, on every device:
    # the engine's weights come from Region.empty on a GPU too, and a bigger rounding assumed there
    # (torch's caching allocator's 512) took a foreign 256-byte block for padding and gathered over it.
    # Tensors torch carved from the region through pool.use (512-byte blocks) may be refused by this
    # rule (a private store), never overwritten.
    rounding = region.alignment
    owned = _merged((s.data_ptr(), round_up(s.data_ptr() + s.nbytes(), rounding))
                    for s in (p.untyped_storage() for p in params))
    owned_starts = [lo for lo, _ in owned]
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start > end:
            i = bisect.bisect_right(owned_starts, end) - 1
            if i < 0 or owned[i][1] < start:
                return None  # something else lies between two parameters
    return spans[0][0], spans[-1][1]


def _tensor_at(address: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor over memory the parameters' storages already own (they keep it alive)."""
    nbytes = numel * dtype.itemsize
    if device.type == "cpu":
        raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
    else:
        raw = torch.as_tensor(_CudaMemory(address, nbytes), device=device)
    return raw.view(dtype)


class _CudaMemory:
    """__cuda_array_interface__ over device memory, which torch.as_tensor wraps without copying."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "stream": None}


def _merged(intervals) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _prefix_sums(values: list[int]) -> list[int]:
    sums, total = [], 0
    for v in values:
        sums.append(total)
        total += v
    return sums
