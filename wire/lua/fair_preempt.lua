-- KEYS: the model's requests stream, its fair base (Keys.fair)
-- ARGV: consumer group, consumer, the stream's cap, TTL, the anonymous slot's name, then
--       the tenant (its FairNames slot) of each generation the worker runs, one per
--       generation
-- A full worker's preemption (engine/preempt.py). VTC orders who goes next at each free
-- slot; a stop keeps the slots the tenants hold here close to their weights: the first
-- waiting tenant, in counter order, that with one more slot would hold fewer per unit of
-- weight than some running tenant holds (or as many, that tenant served more: a higher
-- counter), has its first request moved into the stream and read by this consumer at once,
-- and the running tenant that holds the most per unit of weight is named, to stop a reply
-- of. Nothing while work admitted before waits in
-- the stream: a reply stopped for another goes on at the next free slot. Nothing for a
-- request with no tenant: anonymous requests, or every request with
-- TOKENSPOUT_SCHEDULER=fifo (one list, first come first served), have no share to be owed.
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
local weights = {}
local function weight(tenant)
  if not weights[tenant] then
    weights[tenant] = tonumber(redis.call('HGET', base .. ':weights', tenant) or '1')
  end
  return weights[tenant]
end
local running, order = {}, {}
for i = 6, #ARGV do
  if not running[ARGV[i]] then table.insert(order, ARGV[i]) end
  running[ARGV[i]] = (running[ARGV[i]] or 0) + 1
end
local function counter(tenant)
  return tonumber(redis.call('HGET', base .. ':vtc', tenant) or '0')
end
local waiting = redis.call('ZRANGE', base .. ':ready', 0, 15, 'WITHSCORES')
for i = 1, #waiting, 2 do
  local tenant = waiting[i]
  if tenant ~= ARGV[5] then
    -- At a tie the tenant served more gives way, and never takes it back.
    local victim, most = nil, ((running[tenant] or 0) + 1) / weight(tenant)
    local served = tonumber(waiting[i + 1])
    for _, other in ipairs(order) do
      local held = running[other] / weight(other)
      if other ~= tenant and (held > most or (held == most and counter(other) > served)) then
        victim, most, served = other, held, counter(other)
      end
    end
    if victim then
      if fair_move(base, stream, ARGV[3], tenant, waiting[i + 1]) ~= 1 then return {} end
      local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1,
                               'STREAMS', stream, '>')
      redis.call('EXPIRE', stream, ARGV[4])
      return {victim, reply[1][2]}
    end
  end
end
return {}
