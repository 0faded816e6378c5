-- Limiter.settle (gateway/limits.py): the reservation replaced by the real usage, the
-- concurrency slot freed, the usage counted; at most once per admission (KEYS[7], the
-- done-mark). KEYS: tpm, inflight, quota, usage, the day's usage, rpm, the done-mark, the
-- admission's mark. ARGV: the admission's second, its reservation, whether it was windowed (1),
-- its quota field, prompt, completion and cached tokens, its lease, the day's usage TTL,
-- served (1), the done-mark's TTL, the request's id (what the done-mark holds), billed (1; 0: a
-- batch line's request, whose usage its batch's settle.lua counts with the line's result).
if not redis.call('SET', KEYS[7], ARGV[12], 'NX', 'EX', ARGV[11]) then return 0 end
-- its admission can no longer be run again: only admissions in flight keep their mark
redis.call('DEL', KEYS[8])
local prompt, completion, cached = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local delta = prompt + completion - tonumber(ARGV[2])
if ARGV[3] == '1' and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[1], delta)
end
if ARGV[4] ~= '' then
  redis.call('HINCRBY', KEYS[3], 'total', delta)
  if redis.call('HEXISTS', KEYS[3], ARGV[4]) == 1 then
    redis.call('HINCRBY', KEYS[3], ARGV[4], delta)
  end
end
if ARGV[8] ~= '' then redis.call('ZREM', KEYS[2], ARGV[8]) end
if ARGV[10] == '0' then
  -- the mesh failed the request: its request-per-minute unit is given back, no usage
  if redis.call('HEXISTS', KEYS[6], ARGV[1]) == 1 then
    redis.call('HINCRBY', KEYS[6], ARGV[1], -1)
  end
  return 1
end
if ARGV[13] == '0' then return 1 end
for i = 4, 5 do
  redis.call('HINCRBY', KEYS[i], 'requests', 1)
  redis.call('HINCRBY', KEYS[i], 'prompt_tokens', prompt)
  redis.call('HINCRBY', KEYS[i], 'completion_tokens', completion)
  redis.call('HINCRBY', KEYS[i], 'cached_tokens', cached)
end
redis.call('EXPIRE', KEYS[5], ARGV[9])
return 1
