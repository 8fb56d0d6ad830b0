// The page-lock limit: CAP_IPC_LOCK (bit 14 of a status text's CapEff line) lifts RLIMIT_MEMLOCK.
#include <gtest/gtest.h>

#include "core/page_lock.hpp"

using strata::cap_ipc_lock_in;

TEST(PageLock, CapIpcLockIsBit14OfTheEffectiveSet) {
  EXPECT_TRUE(cap_ipc_lock_in("Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t0000000000004000\n"));
  EXPECT_TRUE(cap_ipc_lock_in("CapEff:\t000001fffeffffff"));     // root's full set, no newline
  EXPECT_FALSE(cap_ipc_lock_in("CapEff:\t00000000a80425fb\n"));  // docker's default: no bit 14
  EXPECT_FALSE(cap_ipc_lock_in("CapPrm:\t0000000000004000\nCapEff:\t0000000000000000\n"));
  EXPECT_FALSE(cap_ipc_lock_in("CapEff:\tzz\n"));  // unreadable: the limit applies
  EXPECT_FALSE(cap_ipc_lock_in("Name:\tx\n"));
  EXPECT_FALSE(cap_ipc_lock_in(""));
}

TEST(PageLock, TheLimitAppliesOnlyWithoutTheCapability) {
  const strata::PageLockLimit l = strata::page_lock_limit();
  EXPECT_EQ(l.applies, l.rlimit != ~0ULL && !l.cap_ipc_lock);
  EXPECT_EQ(l.bytes, l.applies ? l.rlimit : ~0ULL);
}
