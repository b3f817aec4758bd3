# The expected seconds (ctest's COST) of the longest GoogleTest cases, read by ctest
# (cmake/SteptraceTesting.cmake: steptrace_test_costs) so that `ctest -j N` starts them
# first even where it has no cost data of its own (a fresh build tree, as in CI); the
# tests that are not GoogleTest cases set COST where they are defined. Measured with
# `ctest -j2` on a 2-core machine (Testing/Temporary/CTestCostData.txt): only the
# order matters, so round numbers do. A name no test has (renamed, or not configured)
# is ignored.
set_tests_properties(
  HostileLedgerTest.RefusedCallersLeaveNoRowsAndNoUidDistortsTheSharedView
  PROPERTIES COST 18)
set_tests_properties(
  Durability.SigkillRestartsCountWhatTheyLose
  PROPERTIES COST 17)
set_tests_properties(
  Durability.StateDirRestoresAfterKillsDuringSnapshots
  PROPERTIES COST 13)
set_tests_properties(
  DurabilityOnSocket.SigkillRestartsCountWhatTheyLose
  Durability.SigtermRestartsLoseNothing
  DaemonTest.SnapshotsFollowChangesEverySecondAndStopWhileIdle
  DurabilityUnderSystemd.SocketActivatedRestartsUnderLoadLoseNothing
  PROPERTIES COST 8)
set_tests_properties(
  StorageFaultTest.AFullOrReadOnlyStateDirIsShownLoggedOnceAndRecoveredFrom
  LedgerLeaseIntegration.HungHolderIsExpiredWhileAliveAndAnotherProcessCleansItUp
  ShmDeath.PythonTorchDataLoaderWorkersLoseNoSpan
  PROPERTIES COST 7)
set_tests_properties(
  HostileRenderTest.ManyScrapersAtOnceShareRendersAndMemoryDoesNotGrowWithThem
  ShmDeath.SigkilledTrainersLoseNoEvent
  HostileHttpTest.ScrapesAreServedWhileSlowAndSilentConnectionsPileUp
  LedgerLeaseIntegration.LeaseIsKeptAcrossADaemonRestart
  HostileHttpTest.SlowIdleAndKeptAliveConnectionsAreClosedAtTheHeaderTimeout
  PROPERTIES COST 5)
set_tests_properties(
  RankSkewIntegration.ReportWindowNamesTheSlowRank
  DurabilityOnSocket.SigtermRestartsLoseNothing
  Lossless.ExactWhileAnotherClientRendersReportsOfALargeTable
  HostileRenderTest.AnotherUidsCommandsAndScrapesAreAnsweredWhileOneFloodsReports
  LedgerLeaseIntegration.RenewalAfterExpiryRevivesTheReservation
  HostileShareTest.AnotherUidsChurnDoesNotEvictAJustExitedProcess
  CliTraceScripted.ForWaitsItsSecondsBeforeTheTimeoutCounts
  NvmlDaemonTest.SlowLibraryDoesNotBlockIoThread
  PROPERTIES COST 3)
