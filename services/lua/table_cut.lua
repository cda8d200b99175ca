-- A checkpoint's cut of one shard group's embedding tables, in the group's slot (see
-- services/snapshot/checkpoint.py): `take` it (in the MULTI/EXEC that reads the group's dense cut, so its
-- version is that read's), `keep` it while the save streams the tables (renewing its expiry, and
-- saying whether the applies still copy the row-gradient blobs they delete), and `drop` it when done.
-- One save holds a group's cut at a time; a save that dies leaves a cut that expires by itself.
--
-- The cut is the string "<version> <owner> <blobs>" (GroupKeys.table_cut). While it is set, apply.lua
-- and rows_sweep.lua copy the old records a save needs into the shadows before they overwrite or
-- delete them; taking a cut deletes any shadows left (by a save that died, or by this save's previous
-- attempt: they describe another cut), and so does dropping it.
--
-- Called through services.scripts.TableCutCall, which renders KEYS and ARGV by the names below.
-- KEYS[1] version           the group's version
-- KEYS[2] table_cut
-- KEYS[3] rows_blob_shadow
-- KEYS[4..] shadows         each table's rows shadow and seen shadow
-- ARGV[1] op                'take', 'keep' or 'drop'
-- ARGV[2] owner             the save's token (no spaces)
-- ARGV[3] ttl_ms            the cut expires unless renewed within this ('take', 'keep')
-- ARGV[4] blobs             1: the applies copy the row-gradient blobs they delete ('take', 'keep')
--
-- Returns {'OK', version of the cut} ('take', 'keep'), {'OK'} ('drop'); {'BUSY', milliseconds it still
-- holds, held} when another save holds the cut ('take'); {'LOST', held or ''} when this save's cut
-- expired or another save took it ('keep', 'drop': the shadows are no longer this save's).
local K_VERSION = 1
local K_TABLE_CUT = 2
local K_ROWS_BLOB_SHADOW = 3
local K_SHADOWS = 4
local A_OP = 1
local A_OWNER = 2
local A_TTL_MS = 3
local A_BLOBS = 4

local op, owner = ARGV[A_OP], ARGV[A_OWNER]
local held = redis.call('GET', KEYS[K_TABLE_CUT])
local held_version, held_owner
if held then
  held_version, held_owner = string.match(held, '^(%d+) (%S+) %d$')
end
local function clear_shadows()
  redis.call('UNLINK', KEYS[K_ROWS_BLOB_SHADOW], unpack(KEYS, K_SHADOWS))
end

if op == 'take' then
  if held and held_owner ~= owner then
    return {'BUSY', redis.call('PTTL', KEYS[K_TABLE_CUT]), held}
  end
  local version = redis.call('GET', KEYS[K_VERSION]) or '0'
  clear_shadows()
  redis.call('SET', KEYS[K_TABLE_CUT], version .. ' ' .. owner .. ' ' .. ARGV[A_BLOBS], 'PX', ARGV[A_TTL_MS])
  return {'OK', version}
end
if held_owner ~= owner then
  if not held and op == 'drop' then
    clear_shadows()  -- expired: whatever shadows are left describe no cut
  end
  return {'LOST', held or ''}
end
if op == 'keep' then
  redis.call('SET', KEYS[K_TABLE_CUT], held_version .. ' ' .. owner .. ' ' .. ARGV[A_BLOBS], 'PX', ARGV[A_TTL_MS])
  if ARGV[A_BLOBS] ~= '1' then
    redis.call('UNLINK', KEYS[K_ROWS_BLOB_SHADOW])
  end
  return {'OK', held_version}
end
if op == 'drop' then
  redis.call('DEL', KEYS[K_TABLE_CUT])
  clear_shadows()
  return {'OK'}
end
return redis.error_reply('table_cut.lua: unknown op ' .. tostring(op))
