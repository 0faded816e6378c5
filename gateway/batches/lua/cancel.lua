-- BatchRecords.cancel: a running batch becomes cancelling (no line is claimed from then on); any
-- other is left as it is. KEYS: the batch's hash. ARGV: now (unix s). 1: cancelling now.
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
return 1
