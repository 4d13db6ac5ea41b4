-- KEYS: the model's requests stream, its fair base (Keys.fair)
-- ARGV: consumer group, consumer, count, the stream's cap, TTL, '1' to record its free
--       slots for new requests to see ('0': a preempting worker's, none), then what the
--       worker served since it last told: tenant, tokens, tenant, tokens... (it tells with its takes
--       while tenants wait in lists, where the counters order them; else with its
--       heartbeat, FAIR_CHARGE)
-- Charges what was served, then takes up to `count` requests for `consumer`: first what
-- waits in the stream itself (a reply taken over, a request given back: work admitted
-- before), then the tenants' requests in counter order (the smallest first), each moved
-- into the stream (fair_move_lowest) and read at once by this consumer, so the group's
-- pending list, claims and acknowledgements work as for any entry. Rings the bell when more
-- waits, for another idle worker, and records the slots `consumer` has left (fair_free).
-- Returns {the entries taken, as XREADGROUP gives them: {{id, {field, value, ...}}, ...},
--          how many tenants still have requests waiting in their lists}.
local stream, base = KEYS[1], KEYS[2]
local group, consumer, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = nil
if #ARGV >= 7 then now = fair_now_ms() end
for i = 7, #ARGV, 2 do fair_charge(base, ARGV[i], tonumber(ARGV[i + 1]), now) end
local taken = {}
local function read(n)
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n,
                           'STREAMS', stream, '>')
  if not reply then return 0 end
  for _, entry in ipairs(reply[1][2]) do table.insert(taken, entry) end
  return #reply[1][2]
end
local got = read(count)
local ready, moved = base .. ':ready', 0
while got + moved < count do
  local one = fair_move_lowest(base, stream, ARGV[4], now)
  if not one then break end
  moved = moved + one
end
if moved > 0 then
  read(moved)
  redis.call('EXPIRE', stream, ARGV[5])
end
local waiting = redis.call('ZCARD', ready)
if got + moved == count and (got == count or waiting > 0) then fair_ring(base, ARGV[5]) end
-- The slots this worker has free now, for a new request to see (fair_free); a preempting
-- worker offers none: a request waits in a list, where its preemption chooses from.
local free = 0
if ARGV[6] == '1' then free = count - got - moved end
local until_s = tonumber(redis.call('TIME')[1]) + FAIR_FREE_S
redis.call('HSET', base .. ':free', consumer, free .. ' ' .. until_s)
return {taken, waiting}
