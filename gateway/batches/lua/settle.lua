-- BatchRecords.settle: a line's result, kept once, and its usage billed to the key with it; a
-- line already settled (another runner ran it after this one's claim ran out) keeps its first
-- result, and nothing is counted or billed again (its request's own settlement billed nothing:
-- gateway/accounts/lua/settle.lua).
-- KEYS: the batch's hash, its results, its claims, the key's lifetime usage, its day's usage.
-- ARGV: the line, its result (JSON), the count it adds to ("completed" or "failed"), prompt
-- tokens, completion tokens, cached prompt tokens, billed tokens, the day's usage TTL.
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[5])
for i = 4, 5 do
  redis.call('HINCRBY', KEYS[i], 'requests', 1)
  redis.call('HINCRBY', KEYS[i], 'prompt_tokens', ARGV[4])
  redis.call('HINCRBY', KEYS[i], 'completion_tokens', ARGV[5])
  redis.call('HINCRBY', KEYS[i], 'cached_tokens', ARGV[6])
end
redis.call('EXPIRE', KEYS[5], ARGV[8])
redis.call('HINCRBY', KEYS[4], 'batch_requests', 1)
redis.call('HINCRBY', KEYS[4], 'batch_billed_tokens', ARGV[7])
return 1
