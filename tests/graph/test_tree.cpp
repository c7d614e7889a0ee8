#include <gtest/gtest.h>

#include <string>

#include "kiln/errors.h"
#include "kiln/graph/tree.h"

using namespace kiln;
using namespace kiln::graph;

namespace {
// {"x": 1, "layers": [2, {"w": 3, "b": 4}], "y": 5}
Tree<int> sample() {
  return Tree<int>::map({{"x", 1},
                         {"layers", Tree<int>::list({2, Tree<int>::map({{"w", 3}, {"b", 4}})})},
                         {"y", 5}});
}
}  // namespace

TEST(Tree, LeafIsItsOwnFlattening) {
  Tree<int> t(7);
  EXPECT_TRUE(t.is_leaf());
  EXPECT_EQ(t.leaf(), 7);
  EXPECT_EQ(t.num_leaves(), 1u);
  EXPECT_EQ(t.flatten(), std::vector<int>{7});
}

TEST(Tree, FlattenIsDepthFirstInInsertionOrder) {
  Tree<int> t = sample();
  EXPECT_TRUE(t.is_map());
  EXPECT_EQ(t.num_leaves(), 5u);
  EXPECT_EQ(t.flatten(), (std::vector<int>{1, 2, 3, 4, 5}));
  // Map order is insertion order, not key order: "b" after "w".
  EXPECT_EQ(t["layers"][1].entries()[0].first, "w");
  EXPECT_EQ(t["layers"][1]["b"].leaf(), 4);
}

TEST(Tree, UnflattenRebuildsTheSameStructure) {
  Tree<int> t = sample();
  Tree<std::string> named = t.unflatten(std::vector<std::string>{"a", "b", "c", "d", "e"});
  EXPECT_EQ(named["x"].leaf(), "a");
  EXPECT_TRUE(named["layers"].is_list());
  EXPECT_EQ(named["layers"].items().size(), 2u);
  EXPECT_EQ(named["layers"][0].leaf(), "b");
  EXPECT_EQ(named["layers"][1]["w"].leaf(), "c");
  EXPECT_EQ(named["layers"][1]["b"].leaf(), "d");
  EXPECT_EQ(named["y"].leaf(), "e");
  EXPECT_EQ(named.flatten(), (std::vector<std::string>{"a", "b", "c", "d", "e"}));
}

TEST(Tree, EmptyContainersHaveNoLeaves) {
  Tree<int> t = Tree<int>::list({Tree<int>::list({}), Tree<int>::map({}), 9});
  EXPECT_EQ(t.num_leaves(), 1u);
  EXPECT_EQ(t.flatten(), std::vector<int>{9});
  Tree<double> back = t.unflatten(std::vector<double>{0.5});
  EXPECT_TRUE(back[0].is_list());
  EXPECT_TRUE(back[1].is_map());
  EXPECT_EQ(back[2].leaf(), 0.5);
}

TEST(Tree, MapLeavesKeepsStructureAndChangesType) {
  Tree<int> t = sample();
  Tree<std::string> s = t.map_leaves([](int v) { return std::to_string(v * 10); });
  EXPECT_EQ(s.flatten(), (std::vector<std::string>{"10", "20", "30", "40", "50"}));
  EXPECT_EQ(s["layers"][1]["w"].leaf(), "30");
}

TEST(Tree, DuplicateMapKeysAreAValueError) {
  try {
    Tree<int>::map({{"k", 1}, {"j", 2}, {"k", 3}});
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'k'"), std::string::npos) << e.what();
  }
}

TEST(Tree, UnflattenCountMismatchIsAValueError) {
  Tree<int> t = sample();
  try {
    t.unflatten(std::vector<int>{1, 2, 3});
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("5 leaves, got 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(t.unflatten(std::vector<int>(6, 0)), ValueError);
}

TEST(Tree, AccessorsOfTheWrongKindAreValueErrors) {
  Tree<int> t = sample();
  EXPECT_THROW((void)t.leaf(), ValueError);
  EXPECT_THROW((void)t.items(), ValueError);
  EXPECT_THROW((void)t["missing"], ValueError);
  EXPECT_THROW((void)Tree<int>(1).entries(), ValueError);
  EXPECT_THROW((void)t["layers"][5], std::out_of_range);
}
