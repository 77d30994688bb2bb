"""The engine side: the one thread that runs the model, and what it needs.

``engine`` (the thread and its loop), ``startup`` (the parts built once the
model is loaded), ``steps`` (one step = schedule -> run -> postprocess, the
postprocess's detokenizing, stop strings and events, and every request's end),
``scheduler`` with ``request_state`` and ``capacity`` (the request record,
queues, expiry, admission in blocks), ``kv_memory`` (the pool in bytes and the
prompt prefixes cached in it), ``runner`` with ``prefill``, ``sampling`` and
``tasks`` (prefill, batched decode, embeddings and prompt scores), and
``run_output`` (what a pass hands back, the step clock). It talks to routes in
``server.protocol`` records over ``server.channel``; text work (templates,
tokenizing, grammars) is ``server.text``. Nothing here imports FastAPI or knows
HTTP status codes.
"""
