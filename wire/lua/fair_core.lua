-- A model's waiting requests, shared between tenants by the tokens each is served (the
-- Virtual Token Counter; docs/tenants.md). Loaded in front of the fair_* scripts and SUBMIT.
-- base: the model's fair hash (Keys.fair: fields 'waiting' and 'floor'); its sibling keys
-- are named from it by the suffixes FairNames uses (wire/keys.py), all on the queue's slot.

-- The model's bell (one idle worker wakes), or `worker`'s own (the worker wakes).
local function fair_ring(base, ttl, worker)
  local bell = base .. ':bell' .. (worker and (':' .. worker) or '')
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

-- Each worker's free slots as its last take left them: '<base>:free', field the worker,
-- '<slots> <until, unix s> <offered: 1|0>' (fair_take.lua records them with Redis's clock,
-- for FAIR_FREE_S: a worker takes at least every second, so a lost one's lapse). Slots
-- freed since a take count from the next: a worker takes as one frees. A preempting worker
-- offers none to new requests (they wait in a list, where its preemption chooses from),
-- but its free slots count for cache affinity.
local FAIR_FREE_S = 3

-- A record's free slots and, of them, those offered to new requests; nil once lapsed.
local function fair_slots(record, now_s)
  local slots, until_s, offered = string.match(record or '', '^(%d+) (%d+) ([01])$')
  if not slots or tonumber(until_s) < now_s then return nil, 0 end
  return tonumber(slots), offered == '1' and tonumber(slots) or 0
end

-- The slots offered to new requests by the queue's workers, how many workers have a free
-- slot, and what was read (for fair_held: each worker's record, and Redis's clock, s); a
-- lapsed record is dropped.
local function fair_free(base)
  local now_s, key, offered, workers = tonumber(redis.call('TIME')[1]), base .. ':free', 0, 0
  local records, by_worker = redis.call('HGETALL', key), {}
  for i = 1, #records, 2 do
    local slots, offers = fair_slots(records[i + 1], now_s)
    if not slots then
      redis.call('HDEL', key, records[i])
    elseif slots > 0 then
      offered, workers = offered + offers, workers + 1
    end
    by_worker[records[i]] = records[i + 1]
  end
  return offered, workers, {records = by_worker, now_s = now_s}
end

-- Cache affinity (docs/affinity.md). A list entry may name its prompt's prefixes:
-- '<estimate> <names, longest first, comma-separated>|<request>' as the gateway queues it,
-- '<estimate> <queued, ms> <names>|<request>' once queued. A worker that ran a request adds
-- itself to the holders of the names it left in its engine's cache ('<base>:h:<name>', a
-- set, fair_hold.lua), and says with each take how many slots it has free (above). A
-- holder without a free slot (full, draining, gone) is no holder: nothing waits for it.

-- The holders with a free slot of the longest held of `names` (comma-separated, each
-- `name:tokens`, longest first), whether `worker` is among them, and the held prefix's
-- tokens (nil: not told). `read`: what fair_free read just before (nil: read them here).
local function fair_held(base, names, worker, read)
  for prefix in string.gmatch(names, '[^,]+') do
    local name, tokens = string.match(prefix, '^([^:]+):?(%d*)$')
    local members = redis.call('SMEMBERS', base .. ':h:' .. name)
    if #members > 0 then
      local now_s = read and read.now_s or tonumber(redis.call('TIME')[1])
      local free, mine = {}, false
      for _, holder in ipairs(members) do
        if holder == worker then mine = true end
        local record
        if read then
          record = read.records[holder]
        else
          record = redis.call('HGET', base .. ':free', holder)
        end
        if (fair_slots(record, now_s) or 0) > 0 then table.insert(free, holder) end
      end
      return free, mine, tonumber(tokens)
    end
  end
  return {}, false, nil
end

-- fair_held of a list entry, with when the entry was queued (ms; nil: it names none) third.
local function fair_holders(base, element, worker)
  local head = string.sub(element, 1, string.find(element, '|', 1, true) - 1)
  local queued, names = string.match(head, '^%d+ (%d+) (.*)$')
  if not queued then return {}, false, nil end
  local free, mine, tokens = fair_held(base, names, worker)
  return free, mine, tonumber(queued), tokens
end

-- An entry with names, stamped with the time it is queued, its free holders' own bells
-- rung (each waits on it beside the model's: the holder takes it first).
local function fair_stamped(base, element, ttl)
  local space = string.find(element, ' ', 1, true)
  if not space or space > string.find(element, '|', 1, true) then return element end
  local stamped = string.sub(element, 1, space) .. fair_now_ms() .. string.sub(element, space)
  local holders = fair_holders(base, stamped, '')
  for _, holder in ipairs(holders) do fair_ring(base, ttl, holder) end
  return stamped
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
  if redis.call('RPUSH', list, fair_stamped(base, request, ttl)) == 1 then
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
-- (fair_submit). A worker charges its prompt and tokens as it serves it (fair_charge); its
-- tenant's weight is kept for that (fair_weigh). Its entry is as a reply taken over has
-- it, the request alone, and `affinity` ('hit') in its 'a' field if given (it waited 0 ms).
-- The stream's TTL is a live worker's to renew (a worker offered it a slot: its heartbeat
-- renews the stream it reads, engine/lease.py).
local function fair_straight(base, stream, maxlen, tenant, weight, request, ttl, affinity)
  if fair_weigh(base, tenant, weight) then redis.call('EXPIRE', base .. ':weights', ttl) end
  if affinity then
    redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'r', request, 'a', affinity, 'w', 0)
  else
    redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'r', request)
  end
  fair_ring(base, ttl)
end

-- A new request of `tenant` (`element`: as its list would hold it, '<estimate>|<request>'
-- or '<estimate> <names>|<request>') for the queue `stream`, whose group has `lag` entries
-- undelivered (nil: not known) and whose tenants' lists hold `waiting`. It goes straight
-- into the stream when nothing waits in a list, the workers offer a free slot for it and
-- those undelivered before it (VTC, work-conserving, would start it now), and whichever
-- free worker reads it holds its prompt as well as any (no free worker holds its longest
-- held prefix, or every free worker does: an affinity 'hit' wherever it goes); else into
-- its tenant's list, where a free holder takes it first (fair_take.lua). So a request pays
-- for the fair share, and for affinity's wait, only when one could change where it goes.
local function fair_submit(base, stream, maxlen, tenant, weight, element, ttl, lag, waiting)
  if waiting == 0 and lag then
    local offered, free_workers, read = fair_free(base)
    if lag < offered then
      local bar = string.find(element, '|', 1, true)
      local names = string.match(string.sub(element, 1, bar - 1), '^%d+ (.*)$')
      local holders = names and fair_held(base, names, '', read) or {}
      if #holders == 0 or #holders == free_workers then
        local affinity = #holders > 0 and 'hit' or nil
        local request = string.sub(element, bar + 1)
        return fair_straight(base, stream, maxlen, tenant, weight, request, ttl, affinity)
      end
    end
  end
  fair_enqueue(base, tenant, weight, element, ttl)
end

-- Requests waiting in the tenants' lists of the queue `queue` (its fair base is named after
-- it: Keys.fair), for the in-flight counts.
local function fair_waiting(queue)
  return tonumber(redis.call('HGET', '{' .. queue .. '}:fair', 'waiting') or '0')
end

-- The first request of `tenant`, or its request `chosen`, moved from its list into the
-- requests stream at `now`, its prompt charged by the estimate its list entry starts with
-- ('<estimate>|<request>': wire.queue.estimated_tokens, or '<estimate> ...|' with prefix
-- names), which goes into the stream entry's 'e' field for the worker to correct once it
-- knows; `affinity` ('hit', 'miss'), if given, into its 'a' field and the ms it was
-- `waited` queued into its 'w'. Returns 1 when one moved, 0 when the tenant's list was empty.
local function fair_move(base, stream, maxlen, tenant, now, chosen, affinity, waited)
  local list = base .. ':t:' .. tenant
  local element = chosen
  if chosen then redis.call('LREM', list, 1, chosen) else element = redis.call('LPOP', list) end
  if redis.call('LLEN', list) == 0 then redis.call('ZREM', base .. ':ready', tenant) end
  if not element then return 0 end
  local bar = string.find(element, '|', 1, true)
  local estimate = string.match(string.sub(element, 1, bar - 1), '^%d+')
  redis.call('HINCRBY', base, 'waiting', -1)
  fair_charge(base, tenant, tonumber(estimate), now)
  local fields = {'r', string.sub(element, bar + 1), 'e', estimate}
  if affinity then
    for _, item in ipairs({'a', affinity, 'w', waited}) do table.insert(fields, item) end
  end
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', unpack(fields))
  return 1
end

-- fair_move of the tenant with the lowest counter (at `now`; nil: Redis's clock now);
-- false when no tenant waits.
local function fair_move_lowest(base, stream, maxlen, now)
  local lowest = redis.call('ZRANGE', base .. ':ready', 0, 0, 'WITHSCORES')
  if not lowest[1] then return false end
  return fair_move(base, stream, maxlen, lowest[1], now or fair_now_ms())
end
