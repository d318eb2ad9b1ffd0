"""``kvtier engine generate|bench|make-checkpoint``: run the reference engine from the command line.

::

    kvtier engine make-checkpoint /tmp/tiny --layers 2 --hidden 64      # random weights, no download
    echo "1 2 3 4 5" > prompt.txt
    kvtier engine generate --model /tmp/tiny --prompt-file prompt.txt --kvtier unix:/run/kvtier/kvtier.sock
    kvtier engine bench --model /tmp/tiny --prompt-tokens 1024 --kvtier unix:/run/kvtier/kvtier.sock

Exit status: 0 done; 1 the daemon named by ``--kvtier`` cannot be reached; 2 a bad prompt,
checkpoint or request, as argparse's 2 for bad usage (one line on stderr either way). The default
daemon being down is not an error: the engine recomputes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from typing import Any

from kvtier_protocol.codec_plan import CODECS

DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``engine`` and its subcommands to the ``kvtier`` parser."""
    p = subparsers.add_parser("engine", help="run kvtier's reference engine (generate, bench, make-checkpoint)",
                              description="kvtier's reference torch engine with prefix reuse through kvtier")
    sub = p.add_subparsers(dest="engine_command", required=True, metavar="SUBCOMMAND")

    run = argparse.ArgumentParser(add_help=False)
    run.add_argument("--model", metavar="DIR", required=True, help="HF-format checkpoint (config.json + safetensors)")
    where = run.add_mutually_exclusive_group()
    where.add_argument("--kvtier", metavar="ADDRESS", default=None,
                       help="daemon address (unix:/path or tcp://host:port); it must answer. Default: the "
                            "daemon at the default address ($KVTIER_ADDRESS, else the default socket) if one "
                            "answers there, else none")
    where.add_argument("--no-kvtier", action="store_true", help="run without kvtier")
    run.add_argument("--codec", choices=CODECS, default="raw", help="how blocks are stored (raw)")
    run.add_argument("--exact", action="store_true",
                     help="load exact copies only: a block a lossy tier re-encoded (e.g. int8 on disk) is "
                          "recomputed (default: the daemon's store.accept_lossy)")
    run.add_argument("--device", default="cpu", help="torch device (cpu)")
    run.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV dtype (float32)")
    run.add_argument("--block-tokens", type=int, default=16, help="tokens per KV page and kvtier block (16)")
    run.add_argument("--max-step-tokens", type=int, default=4096, help="chunked-prefill budget per step (4096)")
    run.add_argument("--json", action="store_true", help="print the result as JSON")

    g = sub.add_parser("generate", parents=[run], help="generate from a prompt file",
                       description="Generate tokens for one prompt; print them, the TTFT and the prefix hit.")
    g.add_argument("--prompt-file", metavar="FILE", required=True,
                   help="token ids separated by spaces, newlines or commas ('-' reads stdin)")
    g.add_argument("--text", action="store_true", help="the file is text: its UTF-8 bytes are the token ids")
    g.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (16)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.set_defaults(func=lambda args: _guard(_generate, args))

    b = sub.add_parser("bench", parents=[run], help="TTFT with and without a prefix hit (quick)",
                       description="TTFT of a full prefill vs a prefix shared in the engine vs a prefix loaded "
                                   "from kvtier (with --kvtier). The side-by-side suite is `kvtier bench ttft`.")
    b.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length (1024)")
    b.add_argument("--repetitions", type=int, default=3, help="runs per figure, median reported (3)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts (0)")
    b.set_defaults(func=lambda args: _guard(_bench, args))

    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint to try the engine",
                       description="Write an HF-format checkpoint with random weights (LlamaForCausalLM, or "
                                   "DeepseekV2ForCausalLM with --mla) and a fixed seed.")
    m.add_argument("dir", metavar="DIR", help="directory to write config.json and safetensors into")
    m.add_argument("--layers", type=int, default=2, help="decoder layers (2)")
    m.add_argument("--hidden", type=int, default=64, help="hidden size (64)")
    m.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    m.add_argument("--kv-heads", type=int, default=None, help="KV heads for GQA (default: heads / 2)")
    m.add_argument("--intermediate", type=int, default=None, help="MLP size (default: 2 x hidden)")
    m.add_argument("--vocab", type=int, default=256, help="vocabulary size (256: byte-level --text prompts work)")
    m.add_argument("--max-positions", type=int, default=4096, help="max_position_embeddings (4096)")
    m.add_argument("--tie", action="store_true", help="tie the output head to the embeddings")
    m.add_argument("--mla", action="store_true", help="DeepSeek-V2 MLA attention instead of GQA")
    m.add_argument("--kv-lora-rank", type=int, default=None, help="MLA latent width (default: hidden / 2)")
    m.add_argument("--qk-rope-dim", type=int, default=None, help="MLA RoPE key dims (default: head dim / 2)")
    m.add_argument("--seed", type=int, default=0, help="weights seed (0)")
    m.add_argument("--dtype", choices=DTYPES, default="float32", help="weights dtype (float32)")
    m.add_argument("--shards", type=int, default=1, help="safetensors files (1)")
    m.set_defaults(func=lambda args: _guard(_make_checkpoint, args))


def _guard(func: Any, args: argparse.Namespace) -> int:
    """Run ``func``; an error is one line on stderr: exit 1 when the daemon named by ``--kvtier``
    cannot be reached, 2 for a user error (bad prompt, checkpoint, request)."""
    from kvtier_protocol.errors import KVTierError, Unavailable

    try:
        return func(args)
    except (KVTierError, ValueError, OSError) as exc:
        print(f"kvtier engine: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, Unavailable) else 2


def read_prompt(text: str, *, as_text: bool, vocab_size: int) -> list[int]:
    """Token ids of a prompt file's content.

    Raises:
        ValueError: an empty prompt, a word that is not a token id, or an id outside the vocabulary.
    """
    if as_text:
        tokens = list(text.encode("utf-8"))
    else:
        words = [w for w in re.split(r"[\s,]+", text) if w]
        bad = next((w for w in words if not w.isdigit()), None)
        if bad is not None:
            raise ValueError(f"prompt file: {bad!r} is not a token id (use --text for a text prompt)")
        tokens = [int(w) for w in words]
    if not tokens:
        raise ValueError("prompt file: no tokens")
    top = max(tokens)
    if top >= vocab_size:
        raise ValueError(f"prompt file: token id {top} is outside the model's vocabulary of {vocab_size}")
    return tokens


def kvtier_address(args: argparse.Namespace, env: dict[str, str] | None = None) -> str | None:
    """The daemon the engine uses: ``--kvtier`` (which must answer), else the default address if
    a daemon answers there, else None (the engine runs alone, and says so on stderr).

    Raises:
        Unavailable: ``--kvtier`` was given and no daemon answers there (the message names it).
    """
    from kvtier_protocol.address import default_address
    from kvtier_protocol.errors import KVTierError, Unavailable

    from kvtier.client import Client

    if args.no_kvtier:
        return None
    address = args.kvtier or default_address(os.environ if env is None else env)
    try:
        Client.connect(address, timeout_s=2.0, connect_timeout_s=2.0, retries=0).close()
    except KVTierError as exc:
        if args.kvtier:
            raise Unavailable(f"cannot reach the kvtier daemon at {address} (--kvtier): {exc}") from None
        print(f"kvtier engine: no kvtier daemon at {address}; running without kvtier "
              "(--kvtier ADDRESS to name one)", file=sys.stderr)
        return None
    return address


def _engine(args: argparse.Namespace) -> Any:
    import torch

    from kvtier.engine import Engine

    return Engine(args.model, device=args.device, dtype=getattr(torch, args.dtype), block_tokens=args.block_tokens,
                  max_step_tokens=args.max_step_tokens, kvtier_address=kvtier_address(args), codec=args.codec,
                  accept_lossy=False if args.exact else None)


def _generate(args: argparse.Namespace) -> int:
    from kvtier.engine import SamplingParams

    if args.prompt_file == "-":
        content = sys.stdin.read()
    else:
        with open(args.prompt_file, encoding="utf-8") as f:
            content = f.read()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    with _engine(args) as engine:
        prompt = read_prompt(content, as_text=args.text, vocab_size=engine.model.config.vocab_size)
        out = _run_with_progress(engine, prompt, params)
        saved = engine.stats.saved_blocks
    result = {"token_ids": out.token_ids, "ttft_ms": round(out.ttft_s * 1e3, 3), "prompt_tokens": len(prompt),
              "prefix_hit_tokens": out.prefix_hit_tokens, "loaded_tokens": out.loaded_tokens,
              "saved_blocks": saved, "finish_reason": out.finish_reason}
    if args.text:
        result["text"] = bytes(t for t in out.token_ids if t < 256).decode("utf-8", errors="replace")
    if args.json:
        print(json.dumps(result))
        return 0
    print("tokens: " + " ".join(map(str, out.token_ids)))
    if args.text:
        print(f"text: {result['text']!r}")
    print(f"ttft_ms: {result['ttft_ms']}")
    print(f"prefix_hit_tokens: {out.prefix_hit_tokens} of {len(prompt)} (loaded from kvtier: {out.loaded_tokens})")
    print(f"saved_blocks: {saved}")
    return 0


def _run_with_progress(engine: Any, prompt: list[int], params: Any) -> Any:
    """``engine.generate([prompt], params)[0]``, step by step, with a progress line in a terminal
    (a long prompt on a CPU takes minutes, and the command prints nothing until it ends)."""
    from kvtier.commands.progress import Progress

    request_id = engine.add_request(prompt, params)
    out = None
    with Progress("kvtier engine") as bar:
        while engine.has_unfinished():
            for finished in engine.step():
                if finished.request_id == request_id:
                    out = finished
            stats = engine.stats
            bar.update(f"{stats.computed_tokens} tokens computed in {stats.steps} steps "
                       f"(prompt {len(prompt)}, {stats.loaded_tokens} loaded from kvtier)")
        bar.update("saving the new blocks to kvtier", force=True)
        engine.flush()
    assert out is not None, "the request finished"
    return out


def _bench(args: argparse.Namespace) -> int:
    import torch

    from kvtier.engine import SamplingParams

    if args.prompt_tokens < 2 or args.repetitions < 1:
        raise ValueError("need --prompt-tokens >= 2 and --repetitions >= 1")
    one = SamplingParams(max_tokens=1)
    figures: dict[str, list[float]] = {"full_prefill": [], "engine_hit": []}
    hits: dict[str, int] = {}
    with _engine(args) as engine:
        if engine.connector is not None:
            figures["kvtier_hit"] = []
        vocab = engine.model.config.vocab_size
        g = torch.Generator().manual_seed(args.seed)
        engine.generate([torch.randint(0, vocab, (32,), generator=g).tolist()], one)  # warm-up
        for _ in range(args.repetitions):
            # A fresh prompt each time, so the full prefill is a miss in the engine and in kvtier.
            prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist()
            engine.reset_prefix_cache()
            runs = {"full_prefill": engine.generate([prompt], one)[0], "engine_hit": engine.generate([prompt], one)[0]}
            if "kvtier_hit" in figures:
                engine.reset_prefix_cache()
                runs["kvtier_hit"] = engine.generate([prompt], one)[0]
            for name, out in runs.items():
                figures[name].append(out.ttft_s)
                hits[name] = out.prefix_hit_tokens
    medians = {name: statistics.median(v) for name, v in figures.items()}
    result = {"prompt_tokens": args.prompt_tokens, "repetitions": args.repetitions,
              "ttft_ms": {k: round(v * 1e3, 3) for k, v in medians.items()},
              "prefix_hit_tokens": hits,
              "speedup": {k: round(medians["full_prefill"] / v, 2) for k, v in medians.items() if k != "full_prefill"}}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"prompt {args.prompt_tokens} tokens, median of {args.repetitions}")
    for name, ms in result["ttft_ms"].items():
        speed = result["speedup"].get(name)
        extra = f"  {speed}x faster, {hits[name]} tokens reused" if speed else ""
        print(f"  {name:<13} ttft {ms:10.3f} ms{extra}")
    return 0


def _make_checkpoint(args: argparse.Namespace) -> int:
    import torch

    from kvtier.engine.checkpoint import make_random_checkpoint
    from kvtier.engine.config import ModelConfig

    if args.heads < 1 or args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    head_dim = args.hidden // args.heads
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                  intermediate_size=args.intermediate or 2 * args.hidden, tie_word_embeddings=args.tie,
                  max_position_embeddings=args.max_positions)
    if args.mla:
        rope = args.qk_rope_dim or max(2, head_dim // 2)
        cfg = ModelConfig(num_kv_heads=args.heads, head_dim=head_dim + rope, attention="mla",
                          kv_lora_rank=args.kv_lora_rank or max(1, args.hidden // 2), qk_rope_head_dim=rope,
                          qk_nope_head_dim=head_dim, v_head_dim=head_dim, **common)
    else:
        cfg = ModelConfig(num_kv_heads=args.kv_heads or max(1, args.heads // 2), head_dim=head_dim, **common)
    make_random_checkpoint(args.dir, cfg, seed=args.seed, dtype=getattr(torch, args.dtype), shards=args.shards)
    kind = "MLA" if args.mla else "GQA"
    print(f"wrote {args.dir}: {kind}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"seed {args.seed}")
    return 0
