-- The checks and writes of one worker (or gateway) event, shared by EMIT (one event) and
-- EMIT_STEP (every event of an engine step). Loaded after emit_core.lua.
-- keys: events, gen, active, history (the last two only read for a final event)
-- writer: the worker's id ('' for a gateway: no ownership check); final_state: '' unless
-- the event ends its generation; assistant: the message JSON for the history ('' none; it
-- replaces the last one for a turn that continues it);
-- seq: the writer's 1, 2, 3... for this generation (nil: no check); epoch: the takeover its
-- request carries.
-- Returns the entry id, or false when the generation already ended (or expired), or the
-- writer (worker and epoch) does not own it: so "no event after the final one" and "one
-- worker per reply" hold whatever a writer does. 'started'/'resumed' claim a queued
-- generation; before the claim, the current epoch's writer may only end it (a prefill
-- error).
-- A seq at or below the generation's last written one is a retried write (a pipeline sent
-- again after a lost connection): nothing is written, and the reply is the id of the
-- latest event written, so a retry never shows a client an event twice. A seq past the
-- next one means events this writer had written are gone (a failover promoted a replica
-- that had not received them): instead of a silent gap, the generation ends here with an
-- error event, code 'events_lost', and the write is refused (false).
-- What a reader can still read of a reply whose last writes Redis lost, billed with its
-- events_lost end: the prompt its claim noted, and the count of the last event of its
-- writers Redis kept (a token's count, a resumed event's completion_tokens); when none of
-- this epoch's writes is kept (its claim lost, or a takeover since), what its last
-- takeover recorded as streamed before it; else 0.
local function kept_usage(events, gen, last_id)
  local completion = 0
  local entry = last_id and redis.call('XRANGE', events, last_id, last_id)[1]
  if entry then  -- fields: t, <type>, g, <generation>, d, <data>
    local last = cjson.decode(entry[2][6])
    completion = tonumber(last['count'] or last['completion_tokens'] or 0)
  end
  local kept = redis.call('HMGET', gen, 'usage', 'prompt')
  if not entry and kept[1] then
    completion = tonumber(cjson.decode(kept[1])['completion_tokens'] or 0)
  end
  local prompt = tonumber(kept[2] or '0')
  return '{"prompt_tokens":' .. prompt .. ',"completion_tokens":' .. completion .. '}'
end
local function emit_event(events, gen, active, history, channel, maxlen, ttl, etype, gid, data,
                          final_state, writer, assistant, seq, epoch)
  -- One read for the retry, state and owner checks (this runs for every token), and for a
  -- final event what its end reads (FINISH_READS, emit_core.lua).
  local ends = final_state ~= ''
  local seen = redis.call('HMGET', gen, 'seq', 'seq_id', 'state', 'final_id', 'worker',
                          'takeovers', 'continues', unpack(ends and FINISH_READS or {}))
  local read = ends and {unpack(seen, 8, 12)} or nil
  local last = tonumber(seen[1] or '0')
  if seq and seq <= last then return seen[2] end
  if (not seen[3]) or seen[4] then return false end
  local claim = etype == 'started' or etype == 'resumed'
  if claim and seen[3] ~= 'queued' then return false end
  local lost = seq and seq > last + 1
  if writer ~= '' then
    if epoch ~= tonumber(seen[6] or '0') then return false end
    if seen[3] == 'queued' then  -- not claimed: unless the claim itself was lost
      if not claim and not lost and not ends then return false end
    elseif seen[5] ~= writer then return false end
  end
  if lost then
    local error = '{"type":"error","generation_id":' .. cjson.encode(gid) ..
      ',"code":"events_lost","message":"Redis lost events of this reply (a failover to a ' ..
      'replica that had not received them); the reply ends here","usage":' ..
      kept_usage(events, gen, seen[2]) .. '}'
    -- EMIT_STEP passes the active key with final events only; it is the events key's
    -- sibling (wire/keys.py), in the same slot.
    if active == '' then active = string.sub(events, 1, -7) .. 'active' end
    local lost_id = emit(events, gen, channel, maxlen, ttl, 'error', gid, error)
    finish(gen, active, gid, 'error', lost_id, error, ttl, read)
    redis.call('EXPIRE', events, ttl)
    return false
  end
  local id = emit(events, gen, channel, maxlen, ttl, etype, gid, data)
  if not (claim or ends) then  -- a token (every token): its retry check's fields alone
    if seq then redis.call('HSET', gen, 'seq', seq, 'seq_id', id) end
    return id
  end
  -- A claim or an end: its fields and the retry check's in one write.
  local fields = seq and {'seq', seq, 'seq_id', id} or {}
  if claim then
    for _, item in ipairs({'state', 'running', 'worker', writer}) do table.insert(fields, item) end
    if etype == 'started' then  -- its prompt noted, for an end that must bill it (kept_usage)
      table.insert(fields, 'prompt')
      table.insert(fields, string.match(data, '"prompt_tokens":(%d+)') or '0')
    end
  end
  if not ends then
    redis.call('HSET', gen, unpack(fields))
  else
    finish(gen, active, gid, final_state, id, data, ttl, read, fields)
    -- Only a session turn's reply has a place in a history (SUBMIT gave it its 'at'): a
    -- one-shot request's session keeps none (SUBMIT), so its reply makes none either.
    if assistant ~= '' and read[5] then
      -- A continued reply (SUBMIT marked its turn) makes the history's last message, the
      -- one it extends, longer: the session was busy meanwhile, so that is still the one.
      if seen[7] and redis.call('LLEN', history) > 0 then
        redis.call('LSET', history, -1, assistant)
      else
        redis.call('RPUSH', history, assistant)
      end
      redis.call('EXPIRE', history, ttl)
    end
    redis.call('EXPIRE', events, ttl)
  end
  return id
end
