-- Shared by the scripts that write a session event (loaded in front of each). A live
-- message is one event ("<id> <type> <generation id> <json>") or several, one a line (JSON
-- holds no raw newline). PUBLISH on one Redis; SPUBLISH on a cluster (wire/scripts.py swaps
-- this line), so the live channel, tagged like the session's keys, goes to this slot's
-- shard only.
local publish = 'PUBLISH'
-- A script that writes several events (EMIT_STEP) sets `holding`: a session's events that
-- follow one another (a step's token and final) then go in one message, its lines in order,
-- sent when another channel's event comes or the script calls `publish_held`. Only a run
-- is held, never a table per channel: a step of a thousand sessions' one token each costs
-- what a publish each does.
local holding, held_channel, held = false, nil, nil
-- A call starts here (wire/library.py: a library's locals outlive the call that set them).
local function begin_call()
  holding, held_channel, held = false, nil, nil
end
local function publish_held()
  if held_channel then
    redis.call(publish, held_channel, type(held) == 'table' and table.concat(held, '\n') or held)
  end
  held_channel, held = nil, nil
end
local function emit(events, gen, channel, maxlen, ttl, etype, gid, data)
  local id = redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', 't', etype, 'g', gid, 'd', data)
  local line = id .. ' ' .. etype .. ' ' .. gid .. ' ' .. data
  if not holding then
    redis.call(publish, channel, line)
  elseif channel == held_channel then
    if type(held) == 'table' then table.insert(held, line) else held = {held, line} end
  else
    publish_held()
    held_channel, held = channel, line
  end
  return id
end
-- A session turn's reply (its generation knows its place in the history, `at`) is
-- recorded as it ends, in the session's 'replies' hash (the 'active' key's sibling:
-- wire/keys.py): how it ended (the final event), its model, its takeovers, its first and
-- last event ids. What a page shows of a reply after a reload comes from here.
local function record_reply(gen, active, gid, id, data, ttl, at)
  if not at then return end
  local turn = redis.call('HMGET', gen, 'queue', 'takeovers', 'queued_id', 'turn')
  local replies = string.sub(active, 1, -7) .. 'replies'
  redis.call('HSET', replies, at, '{"generation_id":' .. cjson.encode(gid) ..
    ',"model":' .. cjson.encode(turn[1] or '') .. ',"takeovers":' .. (turn[2] or '0') ..
    ',"queued_id":' .. cjson.encode(turn[3] or '') .. ',"final_id":' .. cjson.encode(id) ..
    ',"turn":' .. cjson.encode(turn[4] or '') .. ',"final":' .. data .. '}')
  redis.call('EXPIRE', replies, ttl)
end
-- The generation's fields its end reads: count_usage's (usage_core.lua), then 'at'.
local FINISH_READS = {'tenant', 'bill', 'usage', 'counts', 'at'}
-- Every script that writes a final event calls this, once per generation (a second final
-- is refused before it), so the generation's usage is counted here (usage_core.lua).
-- `read`: the generation's FINISH_READS as its caller read them (nil: read here); `also`:
-- more of its fields to set in the same write (a step's retry check: seq, seq_id).
local function finish(gen, active, gid, state, id, data, ttl, read, also)
  local fields = also or {}
  for _, item in ipairs({'state', state, 'final_id', id, 'final', data}) do
    table.insert(fields, item)
  end
  redis.call('HSET', gen, unpack(fields))
  read = read or redis.call('HMGET', gen, unpack(FINISH_READS))
  count_usage(gen, gid, data, read)
  redis.call('EXPIRE', gen, ttl)
  if redis.call('GET', active) == gid then redis.call('DEL', active) end
  record_reply(gen, active, gid, id, data, ttl, read[5])
end
