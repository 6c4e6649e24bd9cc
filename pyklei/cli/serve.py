"""`pyklei serve`: the OpenAI-compatible HTTP server (pyklei.server; docs/SERVE.md)."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from ._common import (CLIError, _add_chat_template_option, _add_command, _add_model_options, _add_option,
                      _chat_template, _load, _model_path)

# What pyproject.toml's `serve` extra installs. pyklei.server imports them only when the server
# starts, after the model has loaded; `run` imports them first so that a missing extra is one
# line at once, not a traceback after the load.
SERVE_EXTRA_MODULES = ("starlette", "uvicorn", "prometheus_client")


def add_parser(sub):
    from ..runtime.options import ENGINE_OPTION, SERVER_OPTION

    p = _add_command(
        sub, "serve", "OpenAI-compatible HTTP server with a chat page",
        "Serve the model over HTTP: POST /v1/chat/completions and /v1/completions (OpenAI's "
        "API, streamed as Server-Sent Events), GET /v1/models, /health, /metrics (Prometheus) "
        "and a chat page at /. Up to --parallel requests are decoded together (continuous "
        "batching); up to --max-queue more wait, and beyond that a request gets 429. SIGTERM "
        "or Ctrl-C stops accepting connections, lets the replies in flight finish (at most "
        "--drain-timeout seconds) and exits with 0. Several model files (or --models-dir) are "
        "served by one server: a request picks one by its `model` field (the file name without "
        ".gguf), loaded on first use, at most --models-max at once.",
        epilog="examples:\n"
               "  pyklei serve smollm2.gguf --port 8000 --parallel 8\n"
               "  pyklei serve smollm2.gguf --host 0.0.0.0 --api-key $KEY --cors https://my.site\n"
               "  pyklei serve --models-dir ~/models --models-max 2\n"
               "\ndocs/SERVE.md: endpoints, metrics, several replicas behind nginx.")
    p.add_argument("model", metavar="MODEL", nargs="*",
                   help="pyklei .gguf file; several: each is served under its file name "
                        "without .gguf, the first is the default")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s: this machine only; 0.0.0.0 "
                        "or :: exposes the server to the network)")
    _add_option(g, SERVER_OPTION["port"])
    _add_option(g, ENGINE_OPTION["n_parallel"])
    _add_option(g, ENGINE_OPTION["max_queue"])
    _add_option(g, ENGINE_OPTION["cache_ram"])
    g.add_argument("--cache-dir", metavar="DIR",
                   help="keep the prefix cache's blocks in DIR too (a folder per model file and "
                        "KV cache type), so that a restarted server finds its hot prefixes "
                        "(default: memory only)")
    _add_option(g, ENGINE_OPTION["cache_disk"])
    g.add_argument("--api-key", metavar="KEYS", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1, one of these keys "
                        "(comma-separated, repeatable; each key is a tenant: no prompt cache is "
                        "shared across keys). Default: $PYKLEI_API_KEY (comma-separated too), or "
                        "no key; prefer the variable: a flag is visible to every user in ps")
    g.add_argument("--cors", metavar="ORIGINS", action="append", default=[],
                   help="allow browser requests from these origins (comma-separated, or '*'); "
                        "repeatable (default: none)")
    g.add_argument("--model-id", metavar="NAME", help="the model's name in the API (default: the file name)")
    g.add_argument("--models-dir", metavar="DIR",
                   help="serve every pyklei .gguf file in DIR too, each under its file name "
                        "without .gguf (after the MODEL files; the first model is the default, "
                        "for requests that name none)")
    _add_option(g, SERVER_OPTION["models_max"])
    _add_option(g, SERVER_OPTION["drain_timeout"])
    g.add_argument("--allow-host", metavar="NAME", action="append", default=[],
                   help="answer requests whose Host header is NAME, besides 127.0.0.1, localhost "
                        "and ::1 (repeatable; for a reverse proxy or a local DNS name). On a "
                        "loopback address other names get 403, which stops DNS rebinding")
    for name in ("max_connections", "timeout_header", "timeout_body", "timeout_write", "timeout_idle"):
        _add_option(g, SERVER_OPTION[name])
    g.add_argument("--quiet", action="store_true", help="no request log")
    g.add_argument("--special-in-content", action="store_true",
                   help="read special-token text in chat messages (<|im_start|>, <|eot_id|>, "
                        "...) as control tokens. Off: message content is text and only the chat "
                        "template writes control tokens, so a message cannot open a fake turn; "
                        "turn it on only when every client is trusted")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--lookup", action="store_true",
                   help="speculative decoding with prompt lookup for every request (the same "
                        "text; drafts checked inside the batched steps; /metrics counts drafted "
                        "and accepted tokens)")
    x.add_argument("--draft-model", metavar="FILE",
                   help="speculative decoding with this smaller pyklei model of the same "
                        "vocabulary for every request (loaded with the same model options and a "
                        "KV cache slot per parallel sequence; greedy: the same text; sampling: "
                        "the same distribution)")
    r = p.add_argument_group("Ray Serve (the 'ray' extra; docs/SERVE.md)")
    r.add_argument("--ray", action="store_true",
                   help="serve from Ray Serve replicas, each one engine of --threads threads "
                        "and --parallel slots, behind a router that sends a request to the "
                        "replica holding the longest prefix of its prompt (else the "
                        "least-loaded one)")
    r.add_argument("--ray-address", metavar="ADDR",
                   help="the Ray cluster to join (HOST:PORT of its head, ray://HOST:PORT, or "
                        "auto, which joins one running here); default: start a new local one on this "
                        "machine's cores")
    r.add_argument("--replicas", type=_positive, default=None, metavar="N",
                   help="replicas (default 1; with autoscaling the initial number)")
    r.add_argument("--min-replicas", type=_positive, default=None, metavar="N",
                   help="autoscale: at least N replicas (default 1 when --max-replicas is "
                        "given; scaled on ongoing requests, --parallel per replica as the target)")
    r.add_argument("--max-replicas", type=_positive, default=None, metavar="N",
                   help="autoscale: at most N replicas")
    _add_chat_template_option(p, kwargs=False)     # requests carry chat_template_kwargs
    _add_model_options(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        for name in SERVE_EXTRA_MODULES:
            importlib.import_module(name)
        from ..server.run import serve
    except ImportError as e:
        raise CLIError(f"the server needs the 'serve' extra (in a pyklei checkout: pip install -e '.[serve]'): {e}") from None
    cors = [o.strip() for arg in args.cors for o in arg.split(",") if o.strip()]
    keys = args.api_key if args.api_key is not None else [os.environ.get("PYKLEI_API_KEY", "")]
    keys = [k.strip() for arg in keys for k in arg.split(",") if k.strip()] or None
    if args.ray:
        return _run_on_ray(args, keys, cors)
    for flag in ("ray_address", "replicas", "min_replicas", "max_replicas"):
        if getattr(args, flag) is not None:
            raise CLIError(f"--{flag.replace('_', '-')} needs --ray")
    from ..runtime.engine import EMBEDDING_SLOTS
    from ..runtime.options import SERVER_OPTIONS

    # a KV cache slot per parallel sequence, and the embeddings' own (pyklei.runtime.engine)
    n_seq = args.n_parallel + EMBEDDING_SLOTS
    files = _model_files(args)
    loaders = None
    if len(files) > 1 or args.models_dir:
        for flag, value in (("--model-id", args.model_id), ("--draft-model", args.draft_model),
                            ("--chat-template", getattr(args, "chat_template", None))):
            if value is not None:
                raise CLIError(f"{flag} applies to one model, not to several (each is named by "
                               f"its file name and uses the chat template in its file)")
        loaders = {}
        for f in files:
            mid = _file_model_id(f)
            if mid in loaders:
                raise CLIError(f"two model files are named {mid!r}: a request could not choose")
            _model_path(f)        # a missing or non-pyklei file is an error now, not at a request
            loaders[mid] = lambda f=f: _load(args, model=f, n_seq=n_seq)
    args.model = files[0]
    llm = None            # several models: serve() loads the first, the others on demand
    if loaders is None:
        llm = _load(args, n_seq=n_seq)
    speculative = "lookup" if args.lookup else None
    if args.draft_model:      # its slot s drafts for the target's slot s, at the same positions
        speculative = _load(args, model=args.draft_model, n_ctx=llm.n_ctx, n_seq=args.n_parallel)
    model_id = args.model_id or _file_model_id(files[0])
    numbers = {o.name: getattr(args, o.name) for o in SERVER_OPTIONS}
    return serve(llm, host=args.host, model_id=model_id, n_parallel=args.n_parallel,
                 max_queue=args.max_queue, prefill_chunk=args.batch_size, api_key=keys,
                 cors=cors, quiet=args.quiet, allow_hosts=args.allow_host,
                 speculative=speculative, special_in_content=args.special_in_content,
                 loaders=loaders, cache_ram=args.cache_ram, cache_dir=args.cache_dir,
                 cache_disk=args.cache_disk, **numbers)


def _model_files(args) -> list[str]:
    """MODEL..., then --models-dir's pyklei .gguf files (sorted by name); llama.cpp GGUFs in
    the folder are skipped with a note."""
    files = list(args.model)
    if args.models_dir:
        from ..formats.model_file import is_model_file

        d = Path(args.models_dir)
        if not d.is_dir():
            raise CLIError(f"--models-dir {args.models_dir}: no such directory")
        for f in sorted(d.glob("*.gguf")):
            try:
                ours = is_model_file(f)
            except Exception:     # not a GGUF at all
                ours = False
            if ours:
                files.append(str(f))
            else:
                print(f"pyklei serve: skipping {f}: not a pyklei model file (convert it with "
                      f"`pyklei convert {f} -o OUT.gguf`)", file=sys.stderr, flush=True)
    if not files:
        raise CLIError("no model: give a MODEL file or a --models-dir with pyklei .gguf files")
    return files


def _file_model_id(arg: str) -> str:
    """A model file's name in the API: its file name without .gguf (of org/name:file.gguf,
    the file's)."""
    from ..hub import split_file_ref

    ref = split_file_ref(arg)
    return Path(ref[1] if ref else arg).stem


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        import argparse
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return n


def _run_on_ray(args, keys, cors) -> int:
    """`pyklei serve --ray`: one model, its replicas on a Ray cluster
    (pyklei.distributed.ray_serve_run)."""
    from ..distributed.ray_connect import RayUnavailable, import_ray

    files = _model_files(args)
    for flag, bad in (("several models or --models-dir", len(files) > 1 or args.models_dir),
                      ("--draft-model", args.draft_model)):
        if bad:
            raise CLIError(f"--ray serves one model without {flag} (not supported yet)")
    lo, hi = args.min_replicas, args.max_replicas
    if lo is not None and hi is not None and lo > hi:
        raise CLIError(f"--min-replicas {lo} is more than --max-replicas {hi}")
    try:
        import_ray("pyklei serve --ray", part="serve")   # the extra's absence is one line now, before any loading
        for name in SERVE_EXTRA_MODULES:
            importlib.import_module(name)
    except RayUnavailable as e:
        raise CLIError(str(e)) from None
    except ImportError as e:
        raise CLIError(f"the server needs the 'serve' extra (in a pyklei checkout: pip install -e '.[serve]'): {e}") from None
    from ..distributed.ray_serve_run import serve_on_ray
    from ..runtime.engine import EMBEDDING_SLOTS
    from ..server.run import allowed_host_names

    path = str(_model_path(files[0]).resolve())    # every replica opens the file at this path
    load_kwargs = dict(path=path, n_threads=args.threads, n_ctx=args.ctx_size,
                       n_batch=args.batch_size, kv_cache=args.kv_cache,
                       activations=args.activations, n_seq=args.n_parallel + EMBEDDING_SLOTS)
    if getattr(args, "chat_template", None) is not None:
        load_kwargs["chat_template"] = _chat_template(args)
    try:
        return serve_on_ray(
            ray_address=args.ray_address, host=args.host, port=args.port,
            model_id=args.model_id or _file_model_id(files[0]), load_kwargs=load_kwargs,
            engine_kwargs=dict(n_parallel=args.n_parallel, max_queue=args.max_queue,
                               prefill_chunk=args.batch_size,
                               speculative="lookup" if args.lookup else None,
                               drain_timeout=args.drain_timeout,
                               # each replica's prefix cache; a node's replicas may share one
                               # --cache-dir: its blocks are files named by their content's key,
                               # written whole under that name, and a vanished one is a miss
                               cache_ram=args.cache_ram, cache_dir=args.cache_dir,
                               cache_disk=args.cache_disk),
            app_kwargs=dict(api_key=keys, cors=cors, body_timeout=args.timeout_body,
                            write_timeout=args.timeout_write,
                            allowed_hosts=allowed_host_names(args.host, args.allow_host),
                            special_in_content=args.special_in_content),
            replicas=args.replicas or lo or 1, min_replicas=lo, max_replicas=hi)
    except RayUnavailable as e:
        raise CLIError(str(e)) from None
