-- KEYS: the model's requests stream, its fair base (Keys.fair)
-- ARGV: consumer group, consumer, the stream's cap, TTL, the anonymous slot's name, then
--       the tenant (its FairNames slot) of each generation the worker runs, one per
--       generation
-- A full worker's preemption (engine/preempt.py). When the tenant with the lowest counter
-- waits, and a tenant served more (a higher counter) runs more generations here per unit
-- of weight than the waiting one would with one more, the waiting tenant's first request is
-- moved into the stream and read by this consumer at once, and the tenant to stop a reply
-- of (the most served of those) is named. Nothing while work admitted before waits in the
-- stream: a reply stopped for another goes on at the next free slot. Nothing for a request
-- with no tenant: anonymous requests, or every request with TOKENSPOUT_SCHEDULER=fifo (one
-- list, first come first served), have no share to be owed.
-- Returns {} | {tenant to stop, {{id, {field, value, ...}}}}
local stream, base = KEYS[1], KEYS[2]
local group, consumer = ARGV[1], ARGV[2]
local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
if last then
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = {}
    for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
    if fields['name'] == group and fields['last-delivered-id'] ~= last[1] then return {} end
  end
end
local lowest = redis.call('ZRANGE', base .. ':ready', 0, 0, 'WITHSCORES')
if not lowest[1] then return {} end
local waiting, waiting_counter = lowest[1], tonumber(lowest[2])
if waiting == ARGV[5] then return {} end
local running = {}
for i = 6, #ARGV do running[ARGV[i]] = (running[ARGV[i]] or 0) + 1 end
local function weight(tenant)
  return tonumber(redis.call('HGET', base .. ':weights', tenant) or '1')
end
-- With one more slot the waiting tenant must still hold no more slots here, per unit of
-- weight, than the tenant stopped: a stop never takes a tenant past another's share.
local wanted = ((running[waiting] or 0) + 1) / weight(waiting)
local victim, most = nil, waiting_counter
for tenant, slots in pairs(running) do
  local counter = tonumber(redis.call('HGET', base .. ':vtc', tenant) or '0')
  if tenant ~= waiting and counter > most and slots / weight(tenant) >= wanted then
    victim, most = tenant, counter
  end
end
if not victim then return {} end
if fair_move_lowest(base, stream, ARGV[3]) ~= 1 then return {} end
local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1,
                         'STREAMS', stream, '>')
redis.call('EXPIRE', stream, ARGV[4])
return {victim, reply[1][2]}
