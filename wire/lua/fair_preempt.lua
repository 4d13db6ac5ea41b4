-- KEYS: the model's requests stream, its fair base (Keys.fair)
-- ARGV: consumer group, consumer, the stream's cap, TTL, the anonymous slot's name, how
--       many tenants follow that may give way, those tenants (FairNames slots: one per
--       reply), then the tenants of the other replies here (they count in the level only)
-- Whether a reply here gives way to a waiting tenant served far less lately (engine/
-- policies.py, asked by engine/jobs.py): a full worker stops a running reply for it, and a
-- free slot goes to it before a stopped reply's continuation. VTC orders who goes next at a
-- free slot; this serves at once a tenant that asks less than its share:
-- - the tenant served most lately (fair_recent: per unit of weight) among those that may
--   give way gives way, if it was served more than the level: the tokens served lately to
--   the tenants here and waiting, per unit of their weights. A tenant that asks for no
--   more than its share stays at or under the level, and its replies are never stopped,
--   however many it has running for a moment.
-- - the first waiting tenant, in counter order, served less than half as much as that
--   tenant has its first request moved into the stream and read by this consumer at once.
--   The half keeps two tenants served alike from stopping each other's replies by turns.
-- Nothing while no tenant waits in a list (the first look, and all it costs then), nor
-- while work admitted before waits in the stream (a takeover, a request given back).
-- Nothing for a request with no tenant: anonymous requests, or every request with
-- TOKENSPOUT_SCHEDULER=fifo (one list, first come first served), have no share to be owed.
-- Returns {0} (no tenant waits) | {1} (some wait; none is owed a stop here now)
--         | {tenant that gives way, {{id, {field, value, ...}}}}
local stream, base = KEYS[1], KEYS[2]
local group, consumer, yielding = ARGV[1], ARGV[2], tonumber(ARGV[6])
local waiting = redis.call('ZRANGE', base .. ':ready', 0, 15, 'WITHSCORES')
if #waiting == 0 then return {0} end
local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
if last then
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = {}
    for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
    if fields['name'] == group and fields['last-delivered-id'] ~= last[1] then return {1} end
  end
end
local now, lately, weight = fair_now_ms(), {}, {}
local tokens, weights = 0, 0
local function present(tenant)
  if not lately[tenant] then
    lately[tenant] = fair_recent(base, tenant, now)
    weight[tenant] = fair_weight(base, tenant)
    tokens, weights = tokens + lately[tenant] * weight[tenant], weights + weight[tenant]
  end
  return lately[tenant]
end
local victim, most = nil, 0
for i = 7, 6 + yielding do
  if present(ARGV[i]) > most then victim, most = ARGV[i], lately[ARGV[i]] end
end
if not victim then return {1} end
for i = 7 + yielding, #ARGV do present(ARGV[i]) end
for i = 1, #waiting, 2 do present(waiting[i]) end
if most <= tokens / weights then return {1} end
for i = 1, #waiting, 2 do
  local tenant = waiting[i]
  if tenant ~= ARGV[5] and 2 * lately[tenant] < most then
    if fair_move(base, stream, ARGV[3], tenant, now) ~= 1 then return {1} end
    local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1,
                             'STREAMS', stream, '>')
    redis.call('EXPIRE', stream, ARGV[4])
    return {victim, reply[1][2]}
  end
end
return {1}
