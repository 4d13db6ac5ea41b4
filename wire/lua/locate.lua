-- KEYS: a model's requests stream, its fair base (Keys.fair), its notes of requests on
--       their way (Keys.submitting)
-- ARGV: the consumer group, a generation id, how many taken requests are looked at at most
-- Where a request of the generation may be in the queue, read at one moment. Reads made
-- in turns could see it nowhere while it moves: noted, then queued by the stranded-turn
-- repair; taken, then given back to the stream by a worker that drains.
-- Returns 'noted' (a note of it is there: its gateway, or the reaper, queues it from
-- the note), 'waiting' (requests wait in the tenants' lists, or in the stream for a
-- worker: it may be one of them), 'taken' (a worker holds it, not acknowledged), or
-- false: none of these.
local stream, base, submitting = KEYS[1], KEYS[2], KEYS[3]
local group, gid, most = ARGV[1], ARGV[2], tonumber(ARGV[3])
for _, note in ipairs(redis.call('ZRANGE', submitting, 0, -1)) do
  if string.find(note, gid, 1, true) then return 'noted' end
end
if tonumber(redis.call('HGET', base, 'waiting') or '0') > 0 then return 'waiting' end
if redis.call('EXISTS', stream) == 0 then return false end
local delivered = nil
for _, info in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
  local fields = {}
  for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
  if fields['name'] == group then delivered = fields['last-delivered-id'] end
end
if not delivered then  -- no group yet: every entry waits
  return redis.call('XLEN', stream) > 0 and 'waiting' or false
end
if redis.call('XRANGE', stream, '(' .. delivered, '+', 'COUNT', 1)[1] then return 'waiting' end
for _, pending in ipairs(redis.call('XPENDING', stream, group, '-', '+', most)) do
  local entry = redis.call('XRANGE', stream, pending[1], pending[1])[1]
  local fields = entry and entry[2] or {}
  for i = 1, #fields, 2 do
    if fields[i] == 'r' and string.find(fields[i + 1], gid, 1, true) then return 'taken' end
  end
end
return false
