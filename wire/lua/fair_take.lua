-- KEYS: the model's requests stream, its fair base (Keys.fair)
-- ARGV: consumer group, consumer, count, the stream's cap, TTL, then what the worker served
--       since its last call: tenant, tokens, tenant, tokens...
-- Charges what was served, then takes up to `count` requests for `consumer`: first what
-- waits in the stream itself (a reply taken over, a request given back: work admitted
-- before), then the tenants' requests in counter order (the smallest first), each moved
-- into the stream and read at once by this consumer, so the group's pending list, claims
-- and acknowledgements work as for any entry. A moved request's prompt is charged by the
-- estimate its list entry starts with ('<estimate>|<request>': wire.queue.estimated_tokens),
-- which goes into the stream entry's 'e' field for the worker to correct once it knows. Rings the bell when more waits, for another idle worker.
-- Returns the entries taken, as XREADGROUP gives them: {{id, {field, value, ...}}, ...}.
local stream, base = KEYS[1], KEYS[2]
local group, consumer, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
for i = 6, #ARGV, 2 do fair_charge(base, ARGV[i], tonumber(ARGV[i + 1])) end
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
  local lowest = redis.call('ZRANGE', ready, 0, 0, 'WITHSCORES')
  if not lowest[1] then break end
  local tenant, list = lowest[1], base .. ':t:' .. lowest[1]
  local element = redis.call('LPOP', list)
  if redis.call('LLEN', list) == 0 then redis.call('ZREM', ready, tenant) end
  redis.call('HSET', base, 'floor', lowest[2])
  if element then
    local bar = string.find(element, '|', 1, true)
    local estimate = string.sub(element, 1, bar - 1)
    redis.call('HINCRBY', base, 'waiting', -1)
    fair_charge(base, tenant, tonumber(estimate))
    redis.call('XADD', stream, 'MAXLEN', '~', ARGV[4], '*', 'r', string.sub(element, bar + 1),
               'e', estimate)
    moved = moved + 1
  end
end
if moved > 0 then
  read(moved)
  redis.call('EXPIRE', stream, ARGV[5])
end
if got + moved == count and (got == count or redis.call('ZCARD', ready) > 0) then
  fair_ring(base, ARGV[5])
end
return taken
