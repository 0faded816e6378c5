-- BatchRecords.renew: the claims ARGV[3..] still held by ARGV[2] run on until ARGV[1] (ms); a
-- claim another runner took over, or one given back with 0, is left alone.
-- KEYS: the batch's claims.
local renewed = 0
for i = 3, #ARGV do
  local claim = redis.call('HGET', KEYS[1], ARGV[i])
  if claim and string.match(claim, ':(.*)$') == ARGV[2] then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[1] .. ':' .. ARGV[2])
    renewed = renewed + 1
  end
end
return renewed
