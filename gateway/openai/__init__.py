"""OpenAI's API: chat completions, legacy completions, Responses (and its store) and
/v1/models, each endpoint's handler beside its wire format."""
