-- KEYS: meta, history, active, gen, events, watch, idempotency (a key of the session's
--       slot even when unused: a cluster refuses keys of other slots, '' among them)
-- ARGV: channel, maxlen, session_ttl, gid, user message JSON ('' for none), now,
--       max_history, watch_ttl, queued event JSON, token digest ('' for no check),
--       '1' when an idempotency key was given,
--       create ('1': make the session here, a stateless one: the one-shot API requests),
--       companion ('1': another choice of the turn just submitted (a message with n > 1):
--       no message, no busy check, not the session's active generation),
--       note (its request without its conversation: what queues it again should Redis
--       lose it, gateway/core/relay/waiting.py; '' for none), queue (the model's queue it goes to),
--       tenant (who it serves and is billed to: kept with the generation, whose final event
--       counts its usage, usage_core.lua), bill ('all', 'completion': another choice of a
--       request, its prompt billed once; 'none': tokenize, detokenize),
--       turn ('': a new message; 'edit <i>': history message i, a user message, and all
--       after it are cut before the new one; 'regenerate': the history is cut after its
--       last user message; 'continue': its last message, an assistant one, is extended),
--       counts (what its end keeps for its key's limits besides its usage: add_usage's),
--       then, only to admit and queue it here: the in-flight limit, the model's own
--       limit (0: none), the model's queue's place among KEYS[8..], the request (as its
--       tenant's list holds it: '<estimate>|<request>'), the queues' TTL, the workers'
--       consumer group, the request's tenant (its slot in the queue's fair share,
--       wire/lua/fair_core.lua), the tenant's weight and the requests stream's cap,
--       then, only to admit the tenant's limits here too: '1' to count the request ('0':
--       another choice of a request counted already), its limits (concurrent, requests
--       per minute, tokens per minute, tokens per day) and how long a running generation
--       counts at most (ms) (admit_core.lua).
-- KEYS[8..] (admitted here, on one Redis): every model's request queue, counted as the
--       gateway's capacity check counts them (gateway/core/store/queue.py, wire/queue.py).
-- Returns {'ok', queued id, history...} | {'missing'} | {'forbidden'} | {'duplicate', gid}
--         | {'busy', gid} | {'history_full'} | {'overloaded', 'all' or 'model', count}
--         | {'admitted', queued id, counts...} | {'limited', counts...} (the tenant's
--         limits admitted here: admit_tenant's answer)
--         | {'bad_turn', 'edit' or 'regenerate' or 'continue'} (the history has no such turn)
-- A session made here is fresh (a new random id): nothing to look up in it, no history.
-- A generation id is new for each submit: one that exists is this very submit's, sent
-- again because its reply was lost (a client retries a command on a lost connection). It
-- is that generation, as an Idempotency-Key's would be: nothing is admitted, written or
-- queued twice.
if redis.call('EXISTS', KEYS[4]) == 1 then return {'duplicate', ARGV[4]} end
local admit = ARGV[20] ~= nil
local target = admit and tonumber(ARGV[22]) or 0
local lag, waiting = nil, 0  -- of the target queue (fair_submit)
if admit then
  -- A queue's requests in flight: not yet taken (its group's lag; nil after a trim: 0)
  -- and taken but not acknowledged (pending); with no group yet, all it holds; with no
  -- queue yet (XINFO's error), none. Besides: its group's lag (nil: not known) and the
  -- requests in its tenants' lists.
  local function in_flight(queue)
    local listed = fair_waiting(queue)
    local groups = redis.pcall('XINFO', 'GROUPS', queue)
    if groups.err then return listed, 0, listed end
    for _, group in ipairs(groups) do
      local name, behind, pending  -- a flat list: field, value, field, value...
      for i = 1, #group, 2 do
        local field = group[i]
        if field == 'name' then name = group[i + 1]
        elseif field == 'lag' then behind = group[i + 1]
        elseif field == 'pending' then pending = group[i + 1] end
      end
      if name == ARGV[25] then
        return (tonumber(behind) or 0) + pending + listed, tonumber(behind), listed
      end
    end
    local length = redis.call('XLEN', queue)
    return length + listed, length, listed
  end
  local all, of_model = 0, 0
  for i = 8, #KEYS do
    local count, behind, listed = in_flight(KEYS[i])
    all = all + count
    if i - 7 == target then of_model, lag, waiting = count, behind, listed end
  end
  if all >= tonumber(ARGV[20]) then return {'overloaded', 'all', all} end
  local model_limit = tonumber(ARGV[21])
  if model_limit > 0 and of_model >= model_limit then return {'overloaded', 'model', of_model} end
end
-- One Redis holds the tenant's keys too: its limits are admitted in this round trip. A
-- fresh session refuses nothing after this, so nothing admitted is given back.
local counts = nil
if admit and ARGV[29] then
  counts = admit_tenant(tenant_base(KEYS[4], ARGV[16]), ARGV[4], ARGV[29] == '1',
                        tonumber(ARGV[30]), tonumber(ARGV[31]), tonumber(ARGV[32]),
                        tonumber(ARGV[33]), tonumber(ARGV[34]))
  if counts[1] ~= 'ok' then return {'limited', unpack(counts)} end
end
local create = ARGV[12] == '1'
if create then
  redis.call('HSET', KEYS[1], 'stateless', 1, 'created', ARGV[6])
elseif redis.call('EXISTS', KEYS[1]) == 0 then
  return {'missing'}
end
-- The token is checked here, not in a separate round trip. Comparing digests (never the
-- token itself) leaks nothing useful through timing.
if ARGV[10] ~= '' and redis.call('HGET', KEYS[1], 'token') ~= ARGV[10] then
  return {'forbidden'}
end
local companion = ARGV[13] == '1'
if ARGV[11] == '1' and not companion then
  local existing = redis.call('GET', KEYS[7])
  if existing then return {'duplicate', existing} end
end
if not companion and not create then
  local running = redis.call('GET', KEYS[3])
  if running then return {'busy', running} end
end
local turn = ARGV[18]
-- A conversation's record beside its history (wire/keys.py): each reply's ending, and
-- what a regenerate or an edit cut (its earlier versions).
local record = string.sub(KEYS[2], 1, -8)
local replies, versions = record .. 'replies', record .. 'versions'
-- History messages from `from` (0-based) on are cut: they are kept as an earlier version
-- of the message at `from`, with their replies' records; the versions of messages after
-- it belong to the branch cut, so they go inside the new one.
local function keep_version(from)
  local cut = redis.call('LRANGE', KEYS[2], from, -1)
  local kept = {}
  for _, field in ipairs(redis.call('HKEYS', replies)) do
    local i = tonumber(field)
    if i and i >= from then
      if i < from + #cut then
        table.insert(kept, cjson.encode(field) .. ':' .. redis.call('HGET', replies, field))
      end
      redis.call('HDEL', replies, field)
    end
  end
  if #cut == 0 then return end
  local siblings, deeper = {}, {}
  for _, version in ipairs(redis.call('LRANGE', versions, 0, -1)) do
    table.insert(cjson.decode(version).at > from and deeper or siblings, version)
  end
  redis.call('DEL', versions)
  table.insert(siblings, '{"at":' .. from .. ',"turn":' .. cjson.encode(turn) ..
    ',"messages":[' .. table.concat(cut, ',') .. '],"replies":{' .. table.concat(kept, ',') ..
    '},"versions":[' .. table.concat(deeper, ',') .. ']}')
  redis.call('RPUSH', versions, unpack(siblings))
  redis.call('LTRIM', versions, -tonumber(ARGV[7]), -1)
end
if turn ~= '' then
  local history = redis.call('LRANGE', KEYS[2], 0, -1)
  local function role(i) return cjson.decode(history[i]).role end  -- i from 1
  if turn == 'continue' then
    if #history == 0 or role(#history) ~= 'assistant' then return {'bad_turn', turn} end
  elseif turn == 'regenerate' then
    local last = 0
    for i = #history, 1, -1 do
      if role(i) == 'user' then last = i break end
    end
    if last == 0 then return {'bad_turn', turn} end
    keep_version(last)
    redis.call('LTRIM', KEYS[2], 0, last - 1)
  else
    local at = tonumber(string.match(turn, '^edit (%d+)$'))
    if not at or at >= #history or role(at + 1) ~= 'user' then return {'bad_turn', 'edit'} end
    keep_version(at)
    if at == 0 then redis.call('DEL', KEYS[2]) else redis.call('LTRIM', KEYS[2], 0, at - 1) end
  end
end
if ARGV[5] ~= '' then
  local length = redis.call('LLEN', KEYS[2])
  if length >= tonumber(ARGV[7]) then return {'history_full'} end
  redis.call('RPUSH', KEYS[2], ARGV[5])
  redis.call('HDEL', replies, length)  -- a reply there had left no message: it is over
end
local ttl = ARGV[3]
if not companion then
  redis.call('SET', KEYS[3], ARGV[4], 'EX', ttl)
  if ARGV[11] == '1' then redis.call('SET', KEYS[7], ARGV[4], 'EX', ttl) end
end
local fields = {'state', 'queued', 'created', ARGV[6], 'tenant', ARGV[16], 'bill', ARGV[17],
                'counts', ARGV[19]}
if ARGV[14] ~= '' then table.insert(fields, 'note'); table.insert(fields, ARGV[14]) end
if ARGV[15] ~= '' then table.insert(fields, 'queue'); table.insert(fields, ARGV[15]) end
if turn == 'continue' then table.insert(fields, 'continues'); table.insert(fields, 1) end
redis.call('HSET', KEYS[4], unpack(fields))
redis.call('EXPIRE', KEYS[4], ttl)
redis.call('SET', KEYS[6], '1', 'EX', ARGV[8])
local id = emit(KEYS[5], KEYS[4], ARGV[1], ARGV[2], ttl, 'queued', ARGV[4], ARGV[9])
if not companion and not create then
  -- Its reply's place in the history: after the message just added, or the message a
  -- continue extends; and where its events begin (a page rebuilds a running reply from
  -- there).
  local at = redis.call('LLEN', KEYS[2]) - (turn == 'continue' and 1 or 0)
  redis.call('HSET', KEYS[4], 'at', at, 'queued_id', id, 'turn', turn)
end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[5], ttl)
if admit then  -- after its generation, so no worker finds a request with none
  local queue = KEYS[7 + target]
  fair_submit('{' .. queue .. '}:fair', queue, ARGV[28], ARGV[26], ARGV[27], ARGV[23],
              ARGV[24], lag, waiting)
end
local reply = {'ok', id}
if counts then reply = {'admitted', id, unpack(counts)} end
if create and ARGV[5] == '' then return reply end  -- no history to keep or return
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', replies, ttl)
redis.call('EXPIRE', versions, ttl)
for _, message in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do table.insert(reply, message) end
return reply
