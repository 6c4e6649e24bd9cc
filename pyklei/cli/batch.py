"""`pyklei batch`: an OpenAI Batch API input file run offline, on this machine or on Ray Data
(pyklei.batch; docs/BATCH.md)."""
from __future__ import annotations

import os
import sys

from ._common import (CLIError, _add_chat_template_option, _add_command, _add_model_options,
                      _add_option, _chat_template, _int_at_least, _load_kwargs,
                      _model_path, _progress_bar)
from .serve import _file_model_id


def add_parser(sub):
    from ..runtime.options import ENGINE_OPTION

    p = _add_command(
        sub, "batch", "run an OpenAI Batch API file (JSONL) offline",
        "Run every request of INPUT (OpenAI Batch API lines: custom_id, method POST, url "
        "/v1/chat/completions, /v1/completions or /v1/embeddings, body) and write one result "
        "line per request to OUTPUT, in the input's order, in the Batch API's output shape. "
        "Each body is checked and answered as `pyklei serve` answers it; a request that fails "
        "(or a line that is no request) gets an error line naming the field, and the job goes "
        "on. Requests run --parallel at a time through the engine (continuous batching). An "
        "OUTPUT left by a job that stopped is resumed: its complete lines are kept, the rest "
        "is run. With --ray the requests run on Ray Data, an actor pool of --replicas engines "
        "of --threads each; the output is the same.",
        epilog="examples:\n"
               "  pyklei batch smollm2.gguf requests.jsonl -o results.jsonl --parallel 8\n"
               "  pyklei batch smollm2.gguf requests.jsonl -o results.jsonl --ray --replicas 2 "
               "--threads 1\n"
               "  pyklei batch smollm2.gguf requests.jsonl -o results.jsonl --ray "
               "--ray-address 10.0.0.5:6379 --replicas 8 --threads 4\n"
               "\ndocs/BATCH.md: the file formats, resuming, Ray.")
    p.add_argument("model", metavar="MODEL", help="pyklei .gguf file (see `pyklei convert`)")
    p.add_argument("input", metavar="INPUT", help="the requests: a JSONL file of Batch API lines")
    p.add_argument("-o", "--output", metavar="OUTPUT", required=True,
                   help="the results (JSONL); an existing file of this input's results is resumed")
    p.add_argument("--model-id", metavar="NAME",
                   help="the model's name in the results (default: the file name)")
    _add_option(p, ENGINE_OPTION["n_parallel"])
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    r = p.add_argument_group("Ray (the `ray` extra)")
    r.add_argument("--ray", action="store_true",
                   help="run on Ray Data: an actor pool of pyklei engines (a local Ray cluster "
                        "unless --ray-address)")
    r.add_argument("--ray-address", metavar="ADDR",
                   help="a running Ray cluster's address (host:port, ray://host:port or auto)")
    r.add_argument("--replicas", type=_int_at_least(1, "replica count"), default=None,
                   metavar="N", help="engines in the actor pool (default 1), each --parallel "
                                     "sequences on --threads threads (default 1 with --ray), "
                                     "asking Ray for as many CPUs")
    _add_chat_template_option(p, kwargs=False)     # requests carry chat_template_kwargs
    _add_model_options(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from ..batch import lines as L
    from ..batch.job import run_job

    if not args.ray and (args.ray_address or args.replicas):
        flag = "--ray-address" if args.ray_address else "--replicas"
        raise CLIError(f"{flag} applies to --ray")
    if not os.path.isfile(args.input):
        raise CLIError(f"no such input file: {args.input}")
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise CLIError("OUTPUT is the INPUT file: give another name")
    model_path = str(_model_path(args.model))
    model_id = args.model_id or _file_model_id(args.model)
    created = L.created_of(args.input)
    L.read_input(args.input)     # duplicate custom_ids: one line now, before a model loads
    if args.ray:
        results = _on_ray(args, model_path, model_id, created)
    else:
        results = _local(args, model_path, model_id, created)
    with _progress_bar(args, "batch", "req") as progress:
        summary = run_job(args.input, args.output, results, progress=progress)
    print(f"pyklei batch: {args.output}: {summary.line()}", file=sys.stderr)
    return 0


def _model_kwargs(args) -> dict:
    """pyklei.load's keywords of this command's model options, for a load here or in an actor."""
    kw = _load_kwargs(args)
    if getattr(args, "chat_template", None) is not None:
        kw["chat_template"] = _chat_template(args)
    return kw


def _local(args, model_path: str, model_id: str, created: int):
    from ..batch.engine_run import EngineRunner, load_engine

    llm, engine = load_engine(model_path, args.n_parallel, **_model_kwargs(args))

    def results(todo):
        try:
            yield from EngineRunner(engine, llm.tokenizer, model_id, created).run(todo)
        finally:
            engine.shutdown(cancel=True)
    return results


def _on_ray(args, model_path: str, model_id: str, created: int):
    from ..batch.ray_data import run_on_ray
    from ..distributed.ray_connect import connect

    ray = connect(args.ray_address, part="data", what="pyklei batch --ray")
    return lambda todo: run_on_ray(ray, todo, model=model_path, replicas=args.replicas or 1,
                                   threads=args.threads or 1, n_parallel=args.n_parallel,
                                   load_kwargs=_model_kwargs(args), model_id=model_id,
                                   created=created)
