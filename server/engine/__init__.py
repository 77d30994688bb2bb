"""The engine side: the one thread that runs the model, and what it needs.

``engine`` (the thread and its loop), ``startup`` (the parts built once the
model is loaded), ``steps`` (one step = schedule -> run -> postprocess, and
every request's end), ``scheduler`` with ``capacity`` and ``prefix`` (queues,
expiry, admission in blocks, cached prefixes), ``runner`` with ``prefill`` and
``sampling`` (prefill and batched decode), ``output`` (detokenize, stop
strings, events). It talks to routes in ``server.protocol`` records over
``server.channel``; text work (templates, tokenizing, grammars) is
``server.text``. Nothing here imports FastAPI or knows HTTP status codes.
"""
