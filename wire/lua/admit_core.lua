-- A key's admission against its limits (loaded in front of ADMIT, on the key's slot, and of
-- SUBMIT, which admits a one-shot request's key itself on one Redis). Tokens are counted
-- when a generation ends (usage_core.lua), so a request admitted below a token limit may
-- take the tenant past it by its own size. Each count below prunes what left its window
-- and answers its count, when it is back to its initial state (ms), and, at its limit,
-- when it admits again (ms; nil below it).

-- The requests admitted in the last minute: a sorted set of first generation ids by ms.
local function requests_count(key, now, rpm)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - 60000)
  local count = redis.call('ZCARD', key)
  if count == 0 then return 0, 0, nil end
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  local again = nil
  if count >= rpm then
    again = tonumber(redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2]) + 60000 - now
  end
  return count, tonumber(newest[2]) + 60000 - now, again
end

-- The tokens of the last minute: a hash of unix seconds -> tokens (usage_core.lua fills it).
local function tokens_count(key, now, tpm)
  local now_s, seconds, count, last = math.floor(now / 1000), {}, 0, nil
  local buckets = redis.call('HGETALL', key)
  for i = 1, #buckets, 2 do
    local second = tonumber(buckets[i])
    if second <= now_s - 60 then
      redis.call('HDEL', key, buckets[i])
    else
      seconds[#seconds + 1] = {second, tonumber(buckets[i + 1])}
      count = count + seconds[#seconds][2]
      if not last or second > last then last = second end
    end
  end
  if not last then return 0, 0, nil end
  local again = nil
  if count >= tpm then  -- until enough of the minute's tokens left it (oldest first)
    table.sort(seconds, function(a, b) return a[1] < b[1] end)
    local left = count
    for _, bucket in ipairs(seconds) do
      left = left - bucket[2]
      if left < tpm then again = (bucket[1] + 60) * 1000 - now; break end
    end
  end
  return count, (last + 60) * 1000 - now, again
end

-- base: the tenant's key prefix (<prefix>:tenant:{<id>}:); gids: the generation ids,
-- space-separated (the first names the request); count_request: false for another choice
-- of a request counted already; the limits (0: none); hold: how long a running generation
-- counts at most, in ms (should its final event never come: Redis lost it); session: the
-- generations' session when they are written in a round trip after this one (ADMIT's),
-- nil when in this one (SUBMIT's): a gateway lost in between leaves an admission whose
-- generation never exists, which the reaper gives back (gateway/recovery/admissions.py).
-- Admits the generations, or refuses them all when a limit is reached (the one that waits
-- longest is named): read and written in one step, so a limit holds exactly across
-- gateways. Returns {'ok' or the limit reached ('concurrent', 'requests', 'tokens',
-- 'tokens_day'), ms until it admits again (0 when admitted), requests in the last minute,
-- ms until they all left it, tokens in the last minute, ms until they all left it, tokens
-- today, ms until the UTC day ends, generations running}
local function admit_tenant(base, gids_given, count_request, concurrent, rpm, tpm, tpd, hold,
                            session)
  local gids = {}
  for gid in string.gmatch(gids_given, '%S+') do gids[#gids + 1] = gid end
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  local refusal, wait = 'ok', 0
  local function reached(limit, ms)
    if ms and ms >= wait then refusal, wait = limit, math.max(ms, 1) end
  end
  local running, requests, requests_reset, tokens, tokens_reset, again = 0, 0, 0, 0, 0, nil
  if concurrent > 0 then
    redis.call('ZREMRANGEBYSCORE', base .. 'running', '-inf', now)
    running = redis.call('ZCARD', base .. 'running')
    -- No time is known: a generation ends when it ends. A second is a hint.
    if running + #gids > concurrent then reached('concurrent', 1000) end
  end
  if rpm > 0 then
    requests, requests_reset, again = requests_count(base .. 'requests', now, rpm)
    if count_request then reached('requests', again) end
  end
  if tpm > 0 then
    tokens, tokens_reset, again = tokens_count(base .. 'tpm', now, tpm)
    reached('tokens', again)
  end
  local day, today = math.floor(now / 86400000), 0
  local day_ends = (day + 1) * 86400000 - now
  if tpd > 0 then  -- the day's usage (usage_core.lua counts it with every generation)
    local used = redis.call('HMGET', base .. 'usage:day:' .. day, 'prompt_tokens',
                            'completion_tokens')
    today = (tonumber(used[1]) or 0) + (tonumber(used[2]) or 0)
    if today >= tpd then reached('tokens_day', day_ends) end
  end
  if refusal == 'ok' then
    if count_request and rpm > 0 then
      redis.call('ZADD', base .. 'requests', now, gids[1])
      redis.call('PEXPIRE', base .. 'requests', 61000)
      requests, requests_reset = requests + 1, 60000
    end
    if concurrent > 0 then
      for _, gid in ipairs(gids) do
        redis.call('ZADD', base .. 'running', now + hold, gid)
        if session then redis.call('HSET', base .. 'sessions', gid, session) end
      end
      redis.call('PEXPIRE', base .. 'running', hold)
      if session then redis.call('PEXPIRE', base .. 'sessions', hold) end
      running = running + #gids
    end
  end
  return {refusal, wait, requests, requests_reset, tokens, tokens_reset, today, day_ends, running}
end
