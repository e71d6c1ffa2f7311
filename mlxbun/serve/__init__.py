"""command=serve's package: an OpenAI- and Anthropic-compatible server over one model.

command.py        the command: load, open the prompt caches, serve until a signal
httpd.py          the HTTP layer: routes, bodies read with limits, JSON errors, streams
openai_api.py     OpenAI's request fields and response shapes
anthropic_api.py  Anthropic's Messages API
prompts.py        prompts into token ids (the chat template, or a fallback)
checks.py         every request field checked before anything is compiled or queued
engine.py         continuous batching: requests join and leave at token boundaries
solo.py           one sequence at a time, for caches mlx-lm cannot batch (serve.kv_bits)
text.py           tokens into reply text: detokenizing, stop words, token bytes
caches.py         the keyspace every cached prompt is made under
"""
