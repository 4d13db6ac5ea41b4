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

-- `tokens` served to `tenant`: its counter grows by tokens / its weight, and a tenant with
-- requests waiting moves back among them accordingly.
local function fair_charge(base, tenant, tokens)
  local weight = fair_weight(base, tenant)
  local counter = redis.call('HINCRBYFLOAT', base .. ':vtc', tenant, tokens / weight)
  local now = fair_now_ms()
  local recent = math.max(0, fair_recent(base, tenant, now) + tokens / weight)
  redis.call('HSET', base .. ':recent', tenant, string.format('%.17g %d', recent, now))
  if redis.call('ZSCORE', base .. ':ready', tenant) then
    redis.call('ZADD', base .. ':ready', 'XX', counter, tenant)
  end
end

-- Cache affinity (docs/affinity.md). A list entry may name its prompt's prefixes:
-- '<estimate> <names, longest first, comma-separated>|<request>' as the gateway queues it,
-- '<estimate> <queued, ms> <names>|<request>' once queued. A worker that ran a request adds
-- itself to the holders of the names it left in its engine's cache ('<base>:h:<name>', a
-- set, FAIR_HELD_TTL_S), and says with each take how many slots it has free
-- ('<base>:free:<worker>', gone FAIR_FREE_TTL_MS after its last take: a vanished worker
-- holds nothing). A holder without a free slot is no holder: nothing waits for it.
local FAIR_FREE_TTL_MS = 3000

-- The holders with a free slot of an entry's longest held prefix, whether `worker` is
-- among them, when the entry was queued (ms; nil for an entry without prefixes), and the
-- held prefix's tokens (nil: not told). The entry's prefixes are `name:tokens`, longest first.
local function fair_holders(base, element, worker)
  local head = string.sub(element, 1, string.find(element, '|', 1, true) - 1)
  local queued, named = string.match(head, '^%d+ (%d+) (.*)$')
  if not queued then return {}, false, nil end
  for prefix in string.gmatch(named, '[^,]+') do
    local name, tokens = string.match(prefix, '^([^:]+):?(%d*)$')
    local members = redis.call('SMEMBERS', base .. ':h:' .. name)
    if #members > 0 then
      local free, mine = {}, false
      for _, holder in ipairs(members) do
        if holder == worker then mine = true end
        if tonumber(redis.call('GET', base .. ':free:' .. holder) or '0') > 0 then
          table.insert(free, holder)
        end
      end
      return free, mine, tonumber(queued), tonumber(tokens)
    end
  end
  return {}, false, tonumber(queued)
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
-- to the smallest counter of those waiting (none waiting: the counter of the tenant served
-- last), so a tenant cannot bank credit while it sends nothing; lifted, it goes a thousandth
-- of a token below that counter, so it is next rather than behind the tie (a light tenant
-- that comes back waits for one free slot, not two).
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
  end
  redis.call('HSET', base .. ':weights', tenant, weight)
  redis.call('HINCRBY', base, 'waiting', 1)
  for _, key in ipairs({list, ready, vtc, base .. ':recent', base .. ':weights', base}) do
    redis.call('EXPIRE', key, ttl)
  end
  fair_ring(base, ttl)
end

-- Requests waiting in the tenants' lists of the queue `queue` (its fair base is named after
-- it: Keys.fair), for the in-flight counts.
local function fair_waiting(queue)
  return tonumber(redis.call('HGET', '{' .. queue .. '}:fair', 'waiting') or '0')
end

-- The first request of `tenant` (its counter `counter`), or its request `chosen`, moved
-- from its list into the requests stream, its prompt charged by the estimate its list entry
-- starts with ('<estimate>|<request>': wire.queue.estimated_tokens, or '<estimate> ...|'
-- with prefix names), which goes into the stream entry's 'e' field for the worker to
-- correct once it knows; `affinity` ('hit', 'miss'), if given, into its 'a' field and the
-- ms it was `waited` queued into its 'w'. Returns 1 when one moved, 0 when the tenant's list
-- was empty.
local function fair_move(base, stream, maxlen, tenant, counter, chosen, affinity, waited)
  local list = base .. ':t:' .. tenant
  local element = chosen
  if chosen then redis.call('LREM', list, 1, chosen) else element = redis.call('LPOP', list) end
  if redis.call('LLEN', list) == 0 then redis.call('ZREM', base .. ':ready', tenant) end
  redis.call('HSET', base, 'floor', counter)
  if not element then return 0 end
  local bar = string.find(element, '|', 1, true)
  local estimate = string.match(string.sub(element, 1, bar - 1), '^%d+')
  redis.call('HINCRBY', base, 'waiting', -1)
  fair_charge(base, tenant, tonumber(estimate))
  local fields = {'r', string.sub(element, bar + 1), 'e', estimate}
  if affinity then
    for _, item in ipairs({'a', affinity, 'w', waited}) do table.insert(fields, item) end
  end
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', unpack(fields))
  return 1
end

-- fair_move of the tenant with the lowest counter; false when no tenant waits.
local function fair_move_lowest(base, stream, maxlen)
  local lowest = redis.call('ZRANGE', base .. ':ready', 0, 0, 'WITHSCORES')
  if not lowest[1] then return false end
  return fair_move(base, stream, maxlen, lowest[1], lowest[2])
end
