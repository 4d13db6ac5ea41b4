-- A model's waiting requests, shared between tenants by the tokens each is served (the
-- Virtual Token Counter; docs/tenants.md). Loaded in front of the fair_* scripts and SUBMIT.
-- base: the model's fair hash (Keys.fair: fields 'waiting' and 'floor'); its sibling keys
-- are named from it by the suffixes FairNames uses (wire/keys.py), all on the queue's slot.

local function fair_ring(base, ttl)
  local bell = base .. ':bell'
  if redis.call('LLEN', bell) == 0 then
    redis.call('RPUSH', bell, 1)
    redis.call('EXPIRE', bell, ttl)
  end
end

-- What a tenant was served lately, per unit of weight: its tokens, each counting half as
-- much every FAIR_RECENT_HALF_LIFE_MS (stored as '<sum> <when, in ms>'). The counter cannot
-- say it: a tenant that comes back is lifted to the counters of those waiting, so a light
-- tenant looks as served as a heavy one there. Preemption compares these (fair_preempt.lua).
local FAIR_RECENT_HALF_LIFE_MS = 5000
local function fair_now_ms()
  local now = redis.call('TIME')
  return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
local function fair_recent(base, tenant, now)
  local kept = redis.call('HGET', base .. ':recent', tenant)
  if not kept then return 0 end
  local sum, at = string.match(kept, '^(%S+) (%S+)$')
  return tonumber(sum) * 2 ^ ((tonumber(at) - now) / FAIR_RECENT_HALF_LIFE_MS)
end

local function fair_weight(base, tenant)
  return tonumber(redis.call('HGET', base .. ':weights', tenant) or '1')
end

-- `tokens` served to `tenant` at `now` (fair_now_ms): its counter grows by tokens / its
-- weight, and a tenant with requests waiting moves back among them accordingly. One with
-- none waiting (served straight: fair_straight) raises the floor past its counter: the
-- floor is the highest counter served, so a tenant that starts waiting while none waits
-- is lifted to it (fair_enqueue) and banks no credit from a time it did not ask.
local function fair_charge(base, tenant, tokens, now)
  local weight = fair_weight(base, tenant)
  local counter = tonumber(redis.call('HINCRBYFLOAT', base .. ':vtc', tenant, tokens / weight))
  local recent = math.max(0, fair_recent(base, tenant, now) + tokens / weight)
  redis.call('HSET', base .. ':recent', tenant, string.format('%.17g %d', recent, now))
  if redis.call('ZSCORE', base .. ':ready', tenant) then
    redis.call('ZADD', base .. ':ready', 'XX', counter, tenant)
  elseif counter > tonumber(redis.call('HGET', base, 'floor') or '0') then
    redis.call('HSET', base, 'floor', counter)
  end
end

-- A tenant's weight as its request gives it: kept when it is not 1 (fair_weight's default),
-- else dropped (a key whose weight went back to 1). True when the hash got a new field.
local function fair_weigh(base, tenant, weight)
  if tonumber(weight) == 1 then
    redis.call('HDEL', base .. ':weights', tenant)
    return false
  end
  return redis.call('HSET', base .. ':weights', tenant, weight) == 1
end

-- The keys a model's fair share keeps for its tenants, their TTL renewed by a tenant that
-- starts waiting (fair_enqueue) and by a worker's charge beside its takes (FAIR_CHARGE).
local function fair_renew(base, ttl)
  for _, suffix in ipairs({'', ':ready', ':vtc', ':recent', ':weights', ':free'}) do
    redis.call('EXPIRE', base .. suffix, ttl)
  end
end

-- A request waits at the end of its tenant's list. A tenant that had none waiting is lifted
-- to the smallest counter of those waiting (none waiting: the floor, the highest counter
-- served), so a tenant cannot bank credit while it sends nothing; lifted, it goes a
-- thousandth of a token below that counter, so it is next rather than behind the tie (a
-- light tenant that comes back waits for one free slot, not two). Its weight is taken as
-- it starts waiting; the keys' TTLs are renewed then too, so a request that joins a list
-- already waiting costs its list, the count and the bell.
local function fair_enqueue(base, tenant, weight, request, ttl)
  local list, ready, vtc = base .. ':t:' .. tenant, base .. ':ready', base .. ':vtc'
  if redis.call('RPUSH', list, request) == 1 then
    -- A tenant that had nothing waiting: a full worker that preempts may make room for it
    -- (engine/policies.py waits on this bell; it holds at most one ring).
    local newcomer = base .. ':newcomer'
    if redis.call('LLEN', newcomer) == 0 then
      redis.call('RPUSH', newcomer, 1)
      redis.call('EXPIRE', newcomer, ttl)
    end
    local counter = tonumber(redis.call('HGET', vtc, tenant) or '0')
    local lowest = redis.call('ZRANGE', ready, 0, 0, 'WITHSCORES')[2]
    local floor = tonumber(lowest or redis.call('HGET', base, 'floor') or '0')
    if lowest then floor = floor - 0.001 end
    if floor > counter then
      counter = floor
      redis.call('HSET', vtc, tenant, counter)
    end
    redis.call('ZADD', ready, counter, tenant)
    fair_weigh(base, tenant, weight)
    redis.call('EXPIRE', list, ttl)
    fair_renew(base, ttl)
  end
  redis.call('HINCRBY', base, 'waiting', 1)
  fair_ring(base, ttl)
end

-- A new request straight into the requests stream, as though its turn had come at once
-- (fair_submit: a free slot waits for it and nobody waits in a list; VTC would start it now). A worker charges its prompt and
-- tokens as it serves it (fair_charge); its tenant's weight is kept for that (fair_weigh). Its entry is as a reply taken over has it: the request alone.
local function fair_straight(base, stream, maxlen, tenant, weight, request, ttl)
  if fair_weigh(base, tenant, weight) then redis.call('EXPIRE', base .. ':weights', ttl) end
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'r', request)
  redis.call('EXPIRE', stream, ttl)
  fair_ring(base, ttl)
end

-- The free slots of the queue's workers as each one's last take left them (fair_take.lua
-- records them with Redis's clock, for FAIR_FREE_S: a worker takes at least every second,
-- so a lost one's lapse); a lapsed record is dropped. Slots freed since a take count from
-- the next: a worker takes as one frees.
local FAIR_FREE_S = 3
local function fair_free(base)
  local now, free, key = tonumber(redis.call('TIME')[1]), 0, base .. ':free'
  local records = redis.call('HGETALL', key)
  for i = 1, #records, 2 do
    local slots, until_s = string.match(records[i + 1], '^(%d+) (%d+)$')
    if tonumber(until_s) >= now then
      free = free + tonumber(slots)
    else
      redis.call('HDEL', key, records[i])
    end
  end
  return free
end

-- A new request of `tenant` (`element`: '<estimate>|<request>', as its list holds it) for
-- the queue `stream`, whose group has `lag` entries undelivered (nil: not known) and whose
-- tenants' lists hold `waiting`: straight in when nothing waits in a list and a worker has
-- a free slot for it and those undelivered before it (VTC, work-conserving, would start it
-- now; a preempting worker offers none, fair_take.lua), else into its tenant's list. So a
-- request pays for the fair share only when requests wait for a slot.
local function fair_submit(base, stream, maxlen, tenant, weight, element, ttl, lag, waiting)
  if waiting == 0 and lag and lag < fair_free(base) then
    local bar = string.find(element, '|', 1, true)
    fair_straight(base, stream, maxlen, tenant, weight, string.sub(element, bar + 1), ttl)
  else
    fair_enqueue(base, tenant, weight, element, ttl)
  end
end

-- Requests waiting in the tenants' lists of the queue `queue` (its fair base is named after
-- it: Keys.fair), for the in-flight counts.
local function fair_waiting(queue)
  return tonumber(redis.call('HGET', '{' .. queue .. '}:fair', 'waiting') or '0')
end

-- The first request of `tenant`, moved from its list into the requests stream at `now`, its prompt charged by the estimate its list entry starts with
-- ('<estimate>|<request>': wire.queue.estimated_tokens), which goes into the stream entry's
-- 'e' field for the worker to correct once it knows. Returns 1 when one moved, 0 when the
-- tenant's list was empty.
local function fair_move(base, stream, maxlen, tenant, now)
  local list = base .. ':t:' .. tenant
  local element = redis.call('LPOP', list)
  if redis.call('LLEN', list) == 0 then redis.call('ZREM', base .. ':ready', tenant) end
  if not element then return 0 end
  local bar = string.find(element, '|', 1, true)
  local estimate = string.sub(element, 1, bar - 1)
  redis.call('HINCRBY', base, 'waiting', -1)
  fair_charge(base, tenant, tonumber(estimate), now)
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'r', string.sub(element, bar + 1),
             'e', estimate)
  return 1
end

-- fair_move of the tenant with the lowest counter (at `now`; nil: Redis's clock now);
-- false when no tenant waits.
local function fair_move_lowest(base, stream, maxlen, now)
  local lowest = redis.call('ZRANGE', base .. ':ready', 0, 0, 'WITHSCORES')
  if not lowest[1] then return false end
  return fair_move(base, stream, maxlen, lowest[1], now or fair_now_ms())
end
