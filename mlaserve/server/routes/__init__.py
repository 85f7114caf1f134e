"""The HTTP routes, one router per API, their handlers at module level: `openai` (completions,
chat, responses, models), `tokenizer` (vLLM's /tokenize, /detokenize, /tokenizer_info) and
`operations` (health, version, metrics). Each handler reads the app's `ServerState`
(server/state.py) from its request; `api.create_app` includes the routers."""
