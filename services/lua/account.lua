-- Record, in the job's hash slot, what one shard group's apply did: the accounting half of an apply
-- (`apply.lua` is the parameter half, in the group's slot, and keeps this plan in `unaccounted`
-- until this script has run). Idempotent: a group redoing it after a crash counts once.
--
-- Called through services.scripts.AccountCall, which renders KEYS and ARGV by the names below;
-- tests/test_services_protocol.py checks that these lines, the K_/A_/U_ locals and the class agree.
-- KEYS[1] group_accounted
-- KEYS[2] applied_clocks
-- KEYS[3] applied_samples
-- KEYS[4] unapplied
-- KEYS[5] members
-- KEYS[6] clocks
-- KEYS[7] staleness
-- KEYS[8] audit_floor
-- KEYS[9] update_log
-- KEYS[10] group_persisted
-- KEYS[11..] applied_by   the applied_by hash of each update of the plan, in order
-- ARGV[1] plan            msgpack (services.protocol.AccountPlan), below
-- The plan:
--   group, groups
--   from      the group's accounted cursor before this apply ('' when none)
--   to        its cursor after it
--   updates   per update, in log order, a PlanUpdate {update id, member, clock, verdict ('' applied,
--             else why the group refused it), {applied_samples field, value, ...} without status
--             and reason}
--   persisted '' or the group's persisted cursor after this apply
--   housekeep 0, or {horizon ms (0: keep applied_samples forever), most entries to trim}
--
-- An update is accounted once every group has reported it (HSETNX of the group into its
-- applied_by hash, so a report is counted once): the group that completes it raises the member's
-- applied clock, appends its applied_samples entry (status `rejected`, with the first reason, when
-- any group refused it; else `applied`) and lowers `unapplied`. The log keeps every update above
-- the lowest persisted cursor of all groups.
--
-- Bounded state. The group that completes an update of a member no longer in `members` (it left
-- or expired; ids are never reused, and a departed member is fenced from pushing) removes the
-- member's `clocks`, `applied_clocks` and `staleness` fields once all its pushed updates are
-- applied. Housekeeping also sweeps those hashes for departed members with nothing pending, and
-- trims the `applied_samples` entries older than the horizon (by Redis's clock: entry ids are
-- its ms timestamps), oldest first, raising in the same step each partition's `audit_floor` to the
-- highest `next` offset of the trimmed entries: the records below it are no longer accounted one
-- by one (entries complete in log order, and a partition's ranges in log order are contiguous).
--
-- Returns {'OK', updates completed by this call, applied_samples entries trimmed, 1 when more
-- entries are past the horizon than one call trims (else 0), departed members whose fields were
-- removed, log entries trimmed}, {'ALREADY'} when this plan was recorded before, {'PAST', accounted
-- cursor} when the group's accounted cursor is past `to` (recorded before, or overtaken), or
-- {'CURSOR', accounted cursor} when it is neither `from` nor `to` nor past `to`.
local K_GROUP_ACCOUNTED = 1
local K_APPLIED_CLOCKS = 2
local K_APPLIED_SAMPLES = 3
local K_UNAPPLIED = 4
local K_MEMBERS = 5
local K_CLOCKS = 6
local K_STALENESS = 7
local K_AUDIT_FLOOR = 8
local K_UPDATE_LOG = 9
local K_GROUP_PERSISTED = 10
local K_APPLIED_BY = 11
local A_PLAN = 1
-- the fields of each plan update, by position (PlanUpdate)
local U_UPDATE_ID = 1
local U_MEMBER_ID = 2
local U_CLOCK = 3
local U_VERDICT = 4
local U_FIELDS = 5
-- what this script writes into or reads from an applied_samples entry (AccountingRecord)
local F_STATUS = 'status'
local F_REASON = 'reason'
local F_OFFSETS = 'offsets'
local APPLIED = 'applied'
local REJECTED = 'rejected'

local plan = cmsgpack.unpack(ARGV[A_PLAN])
local group, groups = tostring(plan.group), plan.groups

local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function id_le(a, b)  -- stream id a <= b
  local ams, aseq = id_parts(a)
  local bms, bseq = id_parts(b)
  return ams < bms or (ams == bms and aseq <= bseq)
end

local accounted = redis.call('HGET', KEYS[K_GROUP_ACCOUNTED], group) or ''
if accounted ~= plan.from then
  if accounted == plan.to then
    return {'ALREADY'}
  end
  if accounted ~= '' and (plan.to == '' or id_le(plan.to, accounted)) then
    -- past this plan: a group's plans are recorded in cursor order, each from where the one before
    -- ended (and the cursor compare-and-set lets one apply start at each cursor), so another server
    -- of the group recorded this one (finishing it on its load) and went on; a plan without
    -- updates (housekeeping, a persist) was overtaken
    return {'PAST', accounted}
  end
  return {'CURSOR', accounted}
end

-- a departed member's per-member fields go once everything it pushed is applied (`applied`: its
-- applied clock, when the caller knows it)
local function forget_if_done(member, applied)
  if redis.call('HEXISTS', KEYS[K_MEMBERS], member) == 1 then
    return 0
  end
  applied = applied or tonumber(redis.call('HGET', KEYS[K_APPLIED_CLOCKS], member) or '0')
  if applied < tonumber(redis.call('HGET', KEYS[K_CLOCKS], member) or '0') then
    return 0
  end
  redis.call('HDEL', KEYS[K_CLOCKS], member)
  redis.call('HDEL', KEYS[K_APPLIED_CLOCKS], member)
  redis.call('HDEL', KEYS[K_STALENESS], member)
  return 1
end

local completed, forgotten = 0, 0
for n, u in ipairs(plan.updates) do
  local by = KEYS[K_APPLIED_BY + n - 1]
  local member, clock, record = u[U_MEMBER_ID], u[U_CLOCK], u[U_FIELDS]
  if redis.call('HSETNX', by, group, u[U_VERDICT]) == 1 and redis.call('HLEN', by) >= groups then
    local reason = ''
    for _, verdict in ipairs(redis.call('HVALS', by)) do
      if verdict ~= '' and reason == '' then
        reason = verdict
      end
    end
    redis.call('DEL', by)
    local prev = tonumber(redis.call('HGET', KEYS[K_APPLIED_CLOCKS], member) or '0')
    if clock > prev then
      redis.call('HSET', KEYS[K_APPLIED_CLOCKS], member, clock)
      prev = clock
    end
    forgotten = forgotten + forget_if_done(member, prev)
    record[#record + 1] = F_STATUS
    if reason == '' then
      record[#record + 1] = APPLIED
    else
      record[#record + 1] = REJECTED
      record[#record + 1] = F_REASON
      record[#record + 1] = reason
    end
    redis.call('XADD', KEYS[K_APPLIED_SAMPLES], '*', unpack(record))
    redis.call('DECR', KEYS[K_UNAPPLIED])
    completed = completed + 1
  end
end
redis.call('HSET', KEYS[K_GROUP_ACCOUNTED], group, plan.to)

local log_trimmed = 0
if plan.persisted ~= '' then
  redis.call('HSET', KEYS[K_GROUP_PERSISTED], group, plan.persisted)
  -- an update leaves the log once every group's persisted state includes it
  local low = nil
  local reported = redis.call('HGETALL', KEYS[K_GROUP_PERSISTED])
  if #reported / 2 >= groups then
    for j = 2, #reported, 2 do
      if low == nil or not id_le(low, reported[j]) then
        low = reported[j]
      end
    end
  end
  if low then
    local ms, seq = id_parts(low)
    log_trimmed = redis.call('XTRIM', KEYS[K_UPDATE_LOG], 'MINID', string.format('%d-%d', ms, seq + 1))
  end
end

local trimmed, more = 0, 0
if plan.housekeep and plan.housekeep ~= 0 then
  local horizon_ms, most = plan.housekeep[1], plan.housekeep[2]
  local seen = {}
  for _, key in ipairs({KEYS[K_CLOCKS], KEYS[K_APPLIED_CLOCKS], KEYS[K_STALENESS]}) do
    for _, member in ipairs(redis.call('HKEYS', key)) do
      if not seen[member] then
        seen[member] = true
        forgotten = forgotten + forget_if_done(member, nil)
      end
    end
  end
  if horizon_ms > 0 then
    local now = redis.call('TIME')
    local cutoff = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) - horizon_ms
    if cutoff > 0 then
      -- an end id of only ms reaches its last sequence number: every entry of ms < cutoff
      local old = redis.call('XRANGE', KEYS[K_APPLIED_SAMPLES], '-', string.format('%d', cutoff - 1), 'COUNT', most)
      local floors = {}
      local function raise_floors(text)
        for _, range in ipairs(cjson.decode(text)) do
          local p, nxt = string.format('%d', range[1]), tonumber(range[3])
          if floors[p] == nil or nxt > floors[p] then
            floors[p] = nxt
          end
        end
      end
      for _, entry in ipairs(old) do
        local fields = entry[2]
        for j = 1, #fields, 2 do
          if fields[j] == F_OFFSETS then
            -- pcall: an error would leave the writes above done and the reply an error (a
            -- malformed entry, which the server never writes, just raises no floor)
            pcall(raise_floors, fields[j + 1])
          end
        end
      end
      for p, nxt in pairs(floors) do
        if nxt > tonumber(redis.call('HGET', KEYS[K_AUDIT_FLOOR], p) or '0') then
          redis.call('HSET', KEYS[K_AUDIT_FLOOR], p, string.format('%d', nxt))
        end
      end
      trimmed = #old
      if trimmed > 0 then
        local ms, seq = id_parts(old[trimmed][1])
        redis.call('XTRIM', KEYS[K_APPLIED_SAMPLES], 'MINID', string.format('%d-%d', ms, seq + 1))
      end
      if trimmed == most then
        more = 1
      end
    end
  end
end
return {'OK', completed, trimmed, more, forgotten, log_trimmed}
