-- KEYS: the model's requests stream, its fair base (Keys.fair)
-- ARGV: consumer group, consumer, count, the stream's cap, TTL, '1' to offer its free slots
--       to new requests ('0': a preempting worker's, none; fair_free), the most a request
--       waits for affinity (ms; 0: none), the consumer's prefill rate (tokens/s; 0: not
--       measured), then what the worker served since it last told: tenant, tokens, tenant,
--       tokens... (it tells with its takes while tenants wait in lists, where the counters
--       order them; else with its heartbeat, FAIR_CHARGE)
-- Charges what was served, then takes up to `count` requests for `consumer`: first what
-- waits in the stream itself (a reply taken over, a request given back, a request that
-- came straight in: fair_submit), then the tenants' requests in counter order (the
-- smallest first), each moved into the stream (fair_move) and read at once by this
-- consumer, so the group's pending list, claims and acknowledgements work as for any
-- entry. Rings the bell when more waits, for another idle worker, and records the slots
-- `consumer` has left (fair_free, fair_held read them).
-- With a wait for affinity (docs/affinity.md), a tenant's first FAIR_WINDOW requests are
-- looked at, in their order: the first that may go here goes, its prefix held by this
-- consumer ('hit'), or by no worker with a free slot, or its wait for its holders over
-- ('miss'); the others wait for their holders. A request waits at most `wait` ms, and no
-- longer than this consumer would take to prefill its held prefix (the most the wait can
-- save). Only when none of them may go here does the next tenant's turn come.
-- A request placed by affinity carries how long it was queued (ms) in its entry's `w`.
-- Returns {the entries taken, as XREADGROUP gives them: {{id, {field, value, ...}}, ...},
--          how many tenants still have requests waiting in their lists,
--          ms until a request waiting for another worker may go anywhere (0: none waits)}.
local stream, base = KEYS[1], KEYS[2]
local group, consumer, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local wait, prefill_rate = tonumber(ARGV[7]), tonumber(ARGV[8])
local FAIR_WINDOW, FAIR_TENANTS = 8, 16
local now = nil
if #ARGV >= 9 then now = fair_now_ms() end
for i = 9, #ARGV, 2 do fair_charge(base, ARGV[i], tonumber(ARGV[i + 1]), now) end
local taken = {}
local function read(n)
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n,
                           'STREAMS', stream, '>')
  if not reply then return 0 end
  for _, entry in ipairs(reply[1][2]) do table.insert(taken, entry) end
  return #reply[1][2]
end

-- How long a request whose held prefix is `tokens` long waits for its holders (ms).
local function waits_for(tokens)
  if prefill_rate <= 0 or not tokens then return wait end
  return math.min(wait, math.ceil(tokens * 1000 / prefill_rate))
end

-- One request moved for this consumer with affinity: 1, or 0 when none may go here now;
-- `soonest` lowered to the ms until a passed-over request's wait ends.
local soonest = 0
local function move_affine()
  local ready = redis.call('ZRANGE', base .. ':ready', 0, FAIR_TENANTS - 1)
  if ready[1] then now = now or fair_now_ms() end
  for _, tenant in ipairs(ready) do
    for _, element in ipairs(redis.call('LRANGE', base .. ':t:' .. tenant, 0, FAIR_WINDOW - 1)) do
      local holders, mine, queued, tokens = fair_holders(base, element, consumer)
      local left = queued and (queued + waits_for(tokens) - now) or 0
      if mine or #holders == 0 or left <= 0 then
        local outcome = mine and 'hit' or (#holders > 0 and 'miss' or nil)
        local waited = outcome and (now - queued) or nil
        return fair_move(base, stream, ARGV[4], tenant, now, element, outcome, waited)
      end
      soonest = (soonest == 0 or left < soonest) and left or soonest
    end
  end
  return 0
end

local got = read(count)
local ready, moved = base .. ':ready', 0
local waiting = redis.call('ZCARD', ready)
while waiting > 0 and got + moved < count do
  local one
  if wait > 0 then one = move_affine() else one = fair_move_lowest(base, stream, ARGV[4], now) end
  if not one or one == 0 then break end
  moved = moved + one
end
if moved > 0 then
  read(moved)
  redis.call('EXPIRE', stream, ARGV[5])
  waiting = redis.call('ZCARD', ready)
end
if got + moved == count and (got == count or waiting > 0) then fair_ring(base, ARGV[5]) end
local until_s = tonumber(redis.call('TIME')[1]) + FAIR_FREE_S
local record = (count - got - moved) .. ' ' .. until_s .. ' ' .. ARGV[6]
if redis.call('HSET', base .. ':free', consumer, record) == 1 then
  redis.call('EXPIRE', base .. ':free', ARGV[5])  -- a new worker; fair_renew keeps it after
end
return {taken, waiting, soonest}
