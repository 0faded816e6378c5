"""The engine layer: the contract every engine keeps (`api`), the request front every engine puts a
request through, the meters of an engine's speed, the prompt as token ids, the cache-event
publisher the engines feed, and the factory that builds the engine `[engine] kind` names."""
