"""The reference engine: a step loop over the scheduler, the model and the paged KV cache, with
prefix reuse through kvtier.

One step::

    schedule ──► load admitted prefixes from kvtier ──► one forward over every scheduled token
        ──► advance, name computed blocks ──► sample where a prompt (or decode) ended
        ──► save the prompt's new full blocks to kvtier (in the background) ──► finish

Prefix reuse, cheapest first: blocks already computed in this engine's pages are shared; the
next blocks the daemon holds are loaded into fresh pages; the rest is computed. A daemon that is
down or slow answers "no hit" (the connector degrades), so the engine then simply computes.

Layer-wise (the default with a connector): a load's records are fetched and verified before the
step is built (that fixes how many blocks load), then its pages are placed layer by layer while
the forward runs, and layer ``i`` waits only for its own pages (a forward pre-hook per decoder
layer), so on a partial hit loading layer ``i + 1`` overlaps computing the suffix's layer ``i``.
The prompt's blocks are saved the same way: layer ``i`` of their pages is copied out as soon as
layer ``i`` of the step that completes the prompt has run (a forward hook), and stored in the
background; the next step writes pages only after those copies (``release_pages``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvtier_protocol.errors import InvalidRequest
from kvtier_protocol.keys import chain_hashes

from kvtier.engine.attention import AttnBatch
from kvtier.engine.cache import KVCache, PageAllocator
from kvtier.engine.checkpoint import load_model
from kvtier.engine.sampler import Sampler, SamplingParams
from kvtier.engine.scheduler import ScheduledBatch, Scheduler, Sequence

if TYPE_CHECKING:
    from kvtier.connector.core import KVConnectorCore
    from kvtier.connector.layerwise import LayerLoad, LayerSave

DEFAULT_KV_CACHE_BYTES = 512 << 20


@dataclass(slots=True)
class Output:
    """The result of one request.

    Attributes:
        request_id: the id :meth:`Engine.add_request` returned.
        token_ids: the generated tokens.
        prefix_hit_tokens: prompt tokens not computed: shared in the engine or loaded from kvtier.
        loaded_tokens: of those, tokens loaded from kvtier.
        ttft_s: seconds from :meth:`Engine.add_request` to the first token.
        finish_reason: ``"stop"`` (a stop token) or ``"length"`` (``max_tokens``).
        first_logits: ``[vocab]`` float32 logits of the last prompt position (CPU).
        logits: ``[len(token_ids), vocab]`` logits of every generated token, when
            ``SamplingParams.keep_logits``; else None.
    """

    request_id: int
    token_ids: list[int]
    prefix_hit_tokens: int
    loaded_tokens: int
    ttft_s: float
    finish_reason: str
    first_logits: torch.Tensor
    logits: torch.Tensor | None = None


@dataclass(slots=True)
class EngineStats:
    """What the engine did since it was made (or :meth:`reset`)."""

    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0  # tokens through the model (prefill chunks and decodes)
    shared_tokens: int = 0  # prompt tokens shared from pages computed in this engine
    loaded_tokens: int = 0  # prompt tokens loaded from kvtier
    saved_blocks: int = 0  # blocks newly stored in kvtier
    steps: int = 0
    ttft_s: list[float] = field(default_factory=list)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, [] if f.name == "ttft_s" else 0)


@dataclass(slots=True, eq=False)
class _Request:
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    arrival: float
    ttft_s: float = 0.0
    first_logits: torch.Tensor | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    saved: bool = False  # its prompt's blocks are being saved layer-wise


class Engine:
    """A paged-KV engine for one HF-format checkpoint, optionally backed by a kvtier daemon.

    Args:
        model_dir: checkpoint directory (config.json + safetensors).
        device: where the model and its KV cache live.
        dtype: weights, activations and KV dtype.
        block_tokens: tokens per KV page (= per kvtier block).
        num_pages: KV pages; None: as many as fit in 512 MiB.
        max_step_tokens: tokens computed per step at most (the chunked-prefill budget).
        max_num_seqs: sequences running at once at most.
        connector: a connector core to use (bound to this engine's caches here; not closed by
            :meth:`close`). Its namespace must have this engine's ``block_tokens``.
        kvtier_address: without ``connector``, the daemon to connect to (``"unix:/path"``);
            None: no kvtier, prefixes are reused only within this engine.
        codec: how blocks are stored in kvtier (``"raw"``, ``"int8"``, ``"int4"``).
        timeout_s: bound on each daemon call; past it the engine recomputes.
        layerwise: load and save kvtier blocks layer by layer, overlapped with the forward (see
            the module docstring); False: load whole blocks before the forward and save after it.
        accept_lossy: without ``connector``: False takes exact copies only (a block a lossy tier
            re-encoded is recomputed); None: the daemon's default.
    """

    def __init__(self, model_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 block_tokens: int = 16, num_pages: int | None = None, max_step_tokens: int = 4096,
                 max_num_seqs: int = 256, connector: KVConnectorCore | None = None,
                 kvtier_address: str | None = None, codec: str = "raw", timeout_s: float = 2.0,
                 layerwise: bool = True, accept_lossy: bool | None = None) -> None:
        self.device = torch.device(device)
        self.block_tokens = block_tokens
        self.model = load_model(model_dir, device=self.device, dtype=dtype)
        if num_pages is None:
            num_pages = max(1, DEFAULT_KV_CACHE_BYTES // KVCache.bytes_per_page(self.model, block_tokens, dtype))
        self.kv_cache = KVCache(self.model, num_pages, block_tokens, device=self.device, dtype=dtype)
        self._owns_connector = connector is None and kvtier_address is not None
        if self._owns_connector:
            from kvtier.connector import KVConnectorCore, namespace_for_checkpoint

            # hash_tokens by the rule every engine follows (hash_tokens_for), so HF and vLLM find these blocks.
            ns = namespace_for_checkpoint(model_dir, kv_dtype=dtype, block_tokens=block_tokens, codec=codec)
            connector = KVConnectorCore(ns, address=kvtier_address, codec=codec, timeout_s=timeout_s,
                                        page_layout=self.model.kv_block_layout, accept_lossy=accept_lossy)
        if connector is not None:
            if connector.ns.block_tokens != block_tokens:
                raise ValueError(f"the connector's blocks have {connector.ns.block_tokens} tokens, "
                                 f"the engine's pages {block_tokens}")
            connector.bind_kv_caches(self.kv_cache.layers)
        self.connector = connector
        self.allocator = PageAllocator(num_pages, block_tokens)
        self.scheduler = Scheduler(self.allocator, max_step_tokens=max_step_tokens, max_num_seqs=max_num_seqs,
                                   lookup=connector.lookup if connector is not None else None)
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._requests: dict[int, _Request] = {}
        self._save_jobs: list[int] = []
        self._ids = itertools.count()
        self.layerwise = layerwise
        self._step_loads: list[LayerLoad] = []  # this step's layer-wise loads (waited on per layer)
        self._step_saves: list[LayerSave] = []  # this step's layer-wise saves (fed per layer)
        if connector is not None:
            for i, layer in enumerate(self.model.model.layers):
                layer.register_forward_pre_hook(self._layer_hook(i, before=True))
                layer.register_forward_hook(self._layer_hook(i, before=False))

    # -- requests ----------------------------------------------------------------------------------

    def generate(self, prompts: Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Output]:
        """Run ``prompts`` (token ids) to completion in one batch.

        Args:
            prompts: one list of token ids per request.
            params: one for all, or one per prompt; None: greedy, 16 tokens.

        Returns:
            One :class:`Output` per prompt, in order. Blocks saved to kvtier are stored on return.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        requests = [self._new_request(p, sp) for p, sp in zip(prompts, params)]  # all valid before any runs
        ids = [self._enqueue(r) for r in requests]
        done: dict[int, Output] = {}
        while self.has_unfinished():
            done.update((out.request_id, out) for out in self.step())
        self.flush()
        return [done[i] for i in ids]

    def prefill_logits(self, prompt: Seq[int]) -> torch.Tensor:
        """Logits ``[vocab]`` of the last prompt position (with whatever prefix reuse applies)."""
        return self.generate([prompt], SamplingParams(max_tokens=1))[0].first_logits

    def add_request(self, prompt: Seq[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id.

        Raises:
            InvalidRequest: a token id outside the vocabulary, or longer than the model's positions.
            CapacityError: it needs more KV pages than the cache has.
        """
        return self._enqueue(self._new_request(prompt, params or SamplingParams()))

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished()

    def step(self) -> list[Output]:
        """Run one step; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        assert batch.seqs, "unfinished requests but nothing to schedule"
        if self.connector is not None:
            self.connector.release_pages()  # pages a save still reads are written only after its reads
        loads = [(seq, self._load(seq)) for seq in batch.admitted]
        for seq, load in loads:
            self.stats.shared_tokens += seq.num_shared_tokens
            self._loaded(seq, load)
        input_ids, positions, attn, rows = self._prepare(batch)
        self._step_loads = [load for _, load in loads if not isinstance(load, (int, type(None))) and load.num_blocks()]
        self._step_saves = [self._start_save(seq) for seq, n in zip(batch.seqs, batch.num_new_tokens)
                            if self._completes_prompt(seq, n)] if self.layerwise and self.connector else []
        self._step_saves = [s for s in self._step_saves if s is not None]
        try:
            with torch.inference_mode():
                # Logits only where a sequence reaches its end (a sampled token); mid-prompt rows need none.
                logits = self.model(input_ids, positions, attn, self.kv_cache.layers, logits_rows=rows)
        except BaseException:
            for save in self._step_saves:
                save.abandon()
            raise
        finally:
            step_loads, self._step_loads, step_saves, self._step_saves = self._step_loads, [], self._step_saves, []
        for load in step_loads:
            result = load.result()
            if result.num_blocks != load.num_blocks():  # the copies broke off after the count was fixed
                raise RuntimeError(f"a layer-wise load from kvtier failed mid-way ({result.error}); "
                                   "this step's KV is not trustworthy")
        for save in step_saves:
            assert save.job is not None, "the forward ran every layer"
            self._save_jobs.append(save.job)
        self.scheduler.postprocess(batch)
        self.stats.steps += 1
        self.stats.computed_tokens += batch.num_tokens
        ready = [seq for seq in batch.seqs if seq.num_computed_tokens == len(seq.token_ids)]
        return self._sample(ready, logits) if ready else []

    def flush(self) -> None:
        """Wait for the background saves to kvtier to finish."""
        while self._save_jobs:
            assert self.connector is not None, "saves need a connector"
            self.stats.saved_blocks += self.connector.wait(self._save_jobs.pop()).num_blocks

    def reset_prefix_cache(self) -> int:
        """Forget the prefixes held by free pages (so the next request loads from kvtier or computes)."""
        return self.allocator.reset_prefix_cache()

    def close(self) -> None:
        """Finish pending saves and close the connector this engine made."""
        self.flush()
        if self._owns_connector and self.connector is not None:
            self.connector.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------

    def _new_request(self, prompt: Seq[int], params: SamplingParams) -> _Request:
        cfg = self.model.config
        tokens = [int(t) for t in prompt]
        if any(not 0 <= t < cfg.vocab_size for t in tokens):
            raise InvalidRequest(f"token ids must be in [0, {cfg.vocab_size})")
        if len(tokens) + params.max_tokens > cfg.max_position_embeddings:
            raise InvalidRequest(f"{len(tokens)} prompt + {params.max_tokens} new tokens exceed the model's "
                                 f"{cfg.max_position_embeddings} positions")
        seq = Sequence(next(self._ids), tokens, params.max_tokens, block_hashes=self._block_hashes(tokens),
                       stop_token_ids=frozenset(params.stop_token_ids))
        self.scheduler.check_fits(seq)
        generator = None if params.greedy else params.make_generator(self.device)
        return _Request(seq, params, generator, arrival=0.0)

    def _enqueue(self, req: _Request) -> int:
        self.scheduler.add(req.seq)
        req.arrival = time.perf_counter()
        self._requests[req.seq.seq_id] = req
        self.stats.requests += 1
        self.stats.prompt_tokens += req.seq.num_prompt_tokens
        return req.seq.seq_id

    def _block_hashes(self, tokens: list[int]) -> list[bytes]:
        if self.connector is not None:
            return self.connector.block_hashes(tokens)
        # Without kvtier the hashes only have to agree within this engine: one unit per page.
        return chain_hashes(tokens, self.block_tokens)

    def _load(self, seq: Sequence) -> LayerLoad | int | None:
        """Start loading the blocks the daemon said it holds into the sequence's fresh pages: a
        layer-wise load, or (not layer-wise) the whole blocks now; None: nothing to load."""
        first, count = seq.num_shared_tokens // self.block_tokens, seq.num_lookup_tokens // self.block_tokens
        if count == 0 or self.connector is None:
            return None
        hashes, pages = seq.block_hashes[first:first + count], seq.block_table[first:first + count]
        if self.layerwise:
            return self.connector.start_load(hashes, pages)
        return self.connector.load(hashes, pages)

    def _loaded(self, seq: Sequence, load: LayerLoad | int | None) -> None:
        """Account for a load: the verified blocks count as computed, the rest is computed."""
        if load is None:
            return
        first = seq.num_shared_tokens // self.block_tokens
        loaded = load if isinstance(load, int) else load.num_blocks()
        # A block evicted between lookup and load (or a daemon gone) is computed instead.
        seq.num_loaded_tokens = loaded * self.block_tokens
        seq.num_computed_tokens = (first + loaded) * self.block_tokens
        self.stats.loaded_tokens += seq.num_loaded_tokens

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttnBatch, torch.Tensor]:
        """The step's inputs: token ids, positions, the attention batch, and the rows to sample."""
        bt = self.block_tokens
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(seq.block_table[p // bt] * bt + p % bt for p in range(start, start + n))
            if start + n == len(seq.token_ids):  # it samples: keep the logits of its last token
                rows.append(len(ids) - 1)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        attn = AttnBatch(query_lens=list(batch.num_new_tokens),
                         context_lens=[seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_new_tokens)],
                         block_tables=[seq.block_table for seq in batch.seqs], slot_mapping=tensor(slots),
                         block_tokens=bt)
        return tensor(ids), tensor(positions), attn, tensor(rows)

    def _sample(self, ready: list[Sequence], logits: torch.Tensor) -> list[Output]:
        reqs = [self._requests[seq.seq_id] for seq in ready]
        tokens = self.sampler(logits, [r.params for r in reqs], [r.generator for r in reqs])
        now = time.perf_counter()
        finished = []
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            seq = req.seq
            if req.first_logits is None:
                req.ttft_s = now - req.arrival
                req.first_logits = logits[i].cpu()
                self.stats.ttft_s.append(req.ttft_s)
                self._save(seq)
            if req.params.keep_logits:
                req.logits.append(logits[i].cpu())
            if self.scheduler.append_token(seq, token):
                finished.append(self._output(self._requests.pop(seq.seq_id)))
        return finished

    def _layer_hook(self, layer: int, *, before: bool) -> Any:
        """A forward (pre-)hook of decoder layer ``layer``: wait for its pages of this step's
        loads before it runs; feed this step's saves its pages once it has run."""
        def before_layer(module: Any, args: Any) -> None:
            assert self.connector is not None
            for load in self._step_loads:
                load.wait_layer(layer, self.connector.streams.compute)

        def after_layer(module: Any, args: Any, output: Any) -> None:
            for save in self._step_saves:
                save.layer_done(layer)
        return before_layer if before else after_layer

    def _completes_prompt(self, seq: Sequence, n: int) -> bool:
        """Whether this step computes the rest of ``seq``'s prompt (its first token follows)."""
        return self._requests[seq.seq_id].first_logits is None and seq.num_computed_tokens + n == len(seq.token_ids)

    def _save_range(self, seq: Sequence) -> tuple[int, int]:
        """The prompt's full blocks this request computes (not those it shared or loaded)."""
        return seq.num_reused_tokens // self.block_tokens, len(seq.block_hashes)

    def _start_save(self, seq: Sequence) -> LayerSave | None:
        """A layer-wise save of the prompt's blocks, fed by this step's forward; None: nothing to save."""
        assert self.connector is not None
        bt = self.block_tokens
        first, end = self._save_range(seq)
        self._requests[seq.seq_id].saved = True
        if first >= end:
            return None
        return self.connector.start_save(
            seq.block_hashes[first:end], seq.block_table[first:end], token_ids=seq.token_ids[first * bt:end * bt],
            parent=seq.block_hashes[first - 1] if first else None)

    def _save(self, seq: Sequence) -> None:
        """Store the prompt's full blocks this request computed (not those it shared or loaded)."""
        bt = self.block_tokens
        first, end = self._save_range(seq)
        if self.connector is None or first >= end or self._requests[seq.seq_id].saved:
            return
        self._save_jobs.append(self.connector.submit_save(
            seq.block_hashes[first:end], seq.block_table[first:end], token_ids=seq.token_ids[first * bt:end * bt],
            parent=seq.block_hashes[first - 1] if first else None))

    @staticmethod
    def _output(req: _Request) -> Output:
        seq = req.seq
        assert req.first_logits is not None and seq.finish_reason is not None
        return Output(seq.seq_id, seq.output_token_ids, seq.num_reused_tokens, seq.num_loaded_tokens, req.ttft_s,
                      seq.finish_reason, req.first_logits, torch.stack(req.logits) if req.params.keep_logits else None)
