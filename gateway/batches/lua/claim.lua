-- BatchRecords.claim (gateway/batches/records.py): up to ARGV[4] lines of an in-progress batch
-- for one runner, lines whose claim ran out first (their runner died or gave them back), then
-- lines never claimed. None once the batch is cancelling, expired or done.
-- KEYS: the batch's hash, its claims (line -> "<expiry ms>:<owner>").
-- ARGV: now (ms), the claim's life (ms), the owner, the most lines to take.
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return {} end
local now, most = tonumber(ARGV[1]), tonumber(ARGV[4])
if now >= tonumber(redis.call('HGET', KEYS[1], 'expires_at')) * 1000 then return {} end
local taken = {}
local claims = redis.call('HGETALL', KEYS[2])
for i = 1, #claims, 2 do
  if #taken >= most then break end
  if tonumber(string.match(claims[i + 1], '^%d+')) < now then table.insert(taken, claims[i]) end
end
local total = tonumber(redis.call('HGET', KEYS[1], 'total'))
local next_line = tonumber(redis.call('HGET', KEYS[1], 'next') or '0')
while #taken < most and next_line < total do
  table.insert(taken, tostring(next_line))
  next_line = next_line + 1
end
redis.call('HSET', KEYS[1], 'next', next_line)
local claim = (now + tonumber(ARGV[2])) .. ':' .. ARGV[3]
for _, line in ipairs(taken) do redis.call('HSET', KEYS[2], line, claim) end
return taken
