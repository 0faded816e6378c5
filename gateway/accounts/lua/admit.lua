-- Limiter.admit (gateway/limits.py): checks the key and its limits, and either refuses the
-- request or records it, in one atomic step. KEYS: the key's hash, rpm, tpm, inflight, quota,
-- the admission's mark. ARGV: tokens to reserve, the lease id, the lease's TTL in ms, the mark's
-- TTL in s.
-- Idempotent: an admission records its reply in its mark, with its counts; the same admission
-- run again (a client's retry of a round trip whose reply a failover lost) answers that reply
-- and counts nothing.
local replay = redis.call('GET', KEYS[6])
if replay then return cjson.decode(replay) end
local WINDOW_S = 60
local f = redis.call('HMGET', KEYS[1], 'disabled', 'revoked', 'expires_at', 'rpm', 'tpm',
  'max_concurrent', 'quota_tokens', 'quota_period_tokens', 'quota_period_s')
local t = redis.call('TIME')
local now_s = tonumber(t[1])
local now_ms = now_s * 1000 + math.floor(tonumber(t[2]) / 1000)
if f[1] ~= '0' or f[2] == '1' or (f[3] and tonumber(f[3]) <= now_s) then
  return {1}
end
local reserve, lease, lease_ttl_ms = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local rpm, tpm, max_concurrent = tonumber(f[4]), tonumber(f[5]), tonumber(f[6])
local quota, period_quota, period_s = tonumber(f[7]), tonumber(f[8]), tonumber(f[9]) or 86400

-- used units in the window, its bucket seconds (oldest first) and their counts
local function window(key)
  local raw = redis.call('HGETALL', key)
  local used, seconds, counts, stale = 0, {}, {}, {}
  for i = 1, #raw, 2 do
    local s, n = tonumber(raw[i]), tonumber(raw[i + 1])
    if s <= now_s - WINDOW_S then
      stale[#stale + 1] = raw[i]
    else
      used = used + n
      seconds[#seconds + 1] = s
      counts[s] = n
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  table.sort(seconds)
  return {used = used, seconds = seconds, counts = counts}
end
-- ms until cost more units fit under limit; -1: never
local function wait_ms(w, cost, limit)
  if cost > limit then return -1 end
  local used = w.used
  for _, s in ipairs(w.seconds) do
    used = used - w.counts[s]
    if used + cost <= limit then return (s + WINDOW_S) * 1000 - now_ms end
  end
  return 0
end
local function reset_ms(w, newest)
  if newest == nil then newest = w.seconds[#w.seconds] end
  if newest == nil then return 0 end
  return (newest + WINDOW_S) * 1000 - now_ms
end

local refusal, retry = nil, 0
local function refuse(which, ms)
  if refusal == nil then refusal, retry = which, ms end
end
local rw, tw
if rpm then
  rw = window(KEYS[2])
  if rw.used + 1 > rpm then refuse('requests', wait_ms(rw, 1, rpm)) end
end
if tpm then
  tw = window(KEYS[3])
  if reserve > 0 and tw.used + reserve > tpm then refuse('tokens', wait_ms(tw, reserve, tpm)) end
end
if max_concurrent then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now_ms)
  if redis.call('ZCARD', KEYS[4]) >= max_concurrent then refuse('concurrency', 1000) end
end
local period_field = 'p:' .. period_s .. ':' .. math.floor(now_s / period_s)
if reserve > 0 and (quota or period_quota) then
  local q = redis.call('HMGET', KEYS[5], 'total', period_field)
  if quota and (tonumber(q[1]) or 0) + reserve > quota then refuse('quota', -1) end
  if period_quota and (tonumber(q[2]) or 0) + reserve > period_quota then
    refuse('quota_period', (math.floor(now_s / period_s) + 1) * period_s * 1000 - now_ms)
  end
end

local admitted = refusal == nil
local out = {admitted and 0 or 2, refusal or '', retry, -1, 0, 0, -1, 0, 0, now_s, 0, '', 0}
if rpm then
  local used, newest = rw.used, nil
  if admitted then
    redis.call('HINCRBY', KEYS[2], now_s, 1)
    redis.call('PEXPIRE', KEYS[2], (WINDOW_S + 1) * 1000)
    used, newest = used + 1, now_s
  end
  out[4], out[5], out[6] = rpm, math.max(rpm - used, 0), reset_ms(rw, newest)
end
if tpm then
  local used, newest = tw.used, nil
  if admitted and reserve > 0 then
    redis.call('HINCRBY', KEYS[3], now_s, reserve)
    redis.call('PEXPIRE', KEYS[3], (WINDOW_S + 1) * 1000)
    used, newest, out[11] = used + reserve, now_s, 1
  end
  out[7], out[8], out[9] = tpm, math.max(tpm - used, 0), reset_ms(tw, newest)
end
if admitted and max_concurrent then
  redis.call('ZADD', KEYS[4], now_ms + lease_ttl_ms, lease)
  redis.call('PEXPIRE', KEYS[4], lease_ttl_ms)
  out[13] = 1
end
if admitted and reserve > 0 then
  -- kept whether or not a quota is set, so a quota set later sees past usage
  redis.call('HINCRBY', KEYS[5], 'total', reserve)
  if redis.call('HINCRBY', KEYS[5], period_field, reserve) == reserve then
    for _, field in ipairs(redis.call('HKEYS', KEYS[5])) do
      if field ~= 'total' and field ~= period_field then redis.call('HDEL', KEYS[5], field) end
    end
  end
  out[12] = period_field
end
if admitted then redis.call('SET', KEYS[6], cjson.encode(out), 'EX', ARGV[4]) end
return out
