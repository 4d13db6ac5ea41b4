-- KEYS: the tenant's requests, running and tpm keys (wire/keys.py Keys.tenant; its
--       tpd:<day> key is their sibling, named here from Redis's clock)
-- ARGV: the generation ids (space-separated; the first one names the request), '1' to
--       count the request ('0': another choice of a request counted already), the limits
--       (0: none): concurrent generations, requests per minute, tokens per minute, tokens
--       per UTC day; how long a running generation counts at most, in ms (should its final
--       event never come: Redis lost it)
-- Admits the generations, or refuses them all when a limit is reached: read and written
-- in one step on the tenant's slot, so a limit holds exactly across gateways. Tokens are
-- counted when a generation ends (usage_core.lua), so a request admitted below a token
-- limit may take the tenant past it by its own size.
-- Returns {'ok' or the limit reached ('concurrent', 'requests', 'tokens', 'tokens_day'),
--          ms until it admits again (0 when admitted), requests in the last minute,
--          ms until they all left it, tokens in the last minute, ms until they all left
--          it, tokens today, ms until the UTC day ends, generations running}
local base = string.sub(KEYS[1], 1, -9)  -- 'requests'
local gids = {}
for gid in string.gmatch(ARGV[1], '%S+') do gids[#gids + 1] = gid end
local count_request = ARGV[2] == '1'
local concurrent, rpm, tpm, tpd = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6])
local hold = tonumber(ARGV[7])
local clock = redis.call('TIME')
local now_s = tonumber(clock[1])
local now = now_s * 1000 + math.floor(tonumber(clock[2]) / 1000)
local refusal, wait = 'ok', 0
local function reached(limit, ms)
  if ms >= wait then refusal, wait = limit, math.max(ms, 1) end
end

local running = 0
if concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  running = redis.call('ZCARD', KEYS[2])
  -- No time is known: a generation ends when it ends. A second is a hint.
  if running + #gids > concurrent then reached('concurrent', 1000) end
end

local requests, requests_reset = 0, 0
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
  requests = redis.call('ZCARD', KEYS[1])
  if requests > 0 then
    local newest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
    requests_reset = tonumber(newest[2]) + 60000 - now
    if count_request and requests >= rpm then
      local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
      reached('requests', tonumber(oldest[2]) + 60000 - now)
    end
  end
end

local tokens, tokens_reset = 0, 0
if tpm > 0 then
  local seconds = {}
  local buckets = redis.call('HGETALL', KEYS[3])
  for i = 1, #buckets, 2 do
    local second = tonumber(buckets[i])
    if second <= now_s - 60 then
      redis.call('HDEL', KEYS[3], buckets[i])
    else
      local count = tonumber(buckets[i + 1])
      seconds[#seconds + 1] = {second, count}
      tokens = tokens + count
    end
  end
  table.sort(seconds, function(a, b) return a[1] < b[1] end)
  if #seconds > 0 then tokens_reset = (seconds[#seconds][1] + 60) * 1000 - now end
  if tokens >= tpm then  -- until enough of the minute's tokens left it
    local left = tokens
    for _, bucket in ipairs(seconds) do
      left = left - bucket[2]
      if left < tpm then reached('tokens', (bucket[1] + 60) * 1000 - now); break end
    end
  end
end

local day = math.floor(now_s / 86400)
local today = 0
local day_ends = (day + 1) * 86400000 - now
if tpd > 0 then
  today = tonumber(redis.call('GET', base .. 'tpd:' .. day) or '0')
  if today >= tpd then reached('tokens_day', day_ends) end
end

if refusal == 'ok' then
  if count_request and rpm > 0 then
    redis.call('ZADD', KEYS[1], now, gids[1])
    redis.call('PEXPIRE', KEYS[1], 61000)
    requests, requests_reset = requests + 1, 60000
  end
  if concurrent > 0 then
    for _, gid in ipairs(gids) do redis.call('ZADD', KEYS[2], now + hold, gid) end
    redis.call('PEXPIRE', KEYS[2], hold)
    running = running + #gids
  end
end
return {refusal, wait, requests, requests_reset, tokens, tokens_reset, today, day_ends, running}
