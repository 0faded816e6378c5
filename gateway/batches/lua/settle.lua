-- BatchRecords.settle: a line's result, kept once; a line already settled (another runner ran
-- it after this one's claim ran out) keeps its first result, and nothing is counted again.
-- KEYS: the batch's hash, its results, its claims, the key's lifetime usage.
-- ARGV: the line, its result (JSON), the count it adds to ("completed" or "failed"), prompt
-- tokens, completion tokens, billed tokens.
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[4], 'batch_requests', 1)
redis.call('HINCRBY', KEYS[4], 'batch_billed_tokens', ARGV[6])
return 1
